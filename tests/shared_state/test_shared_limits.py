"""Rate limits in PostgreSQL: the same decisions and headers as the in-memory limiter, and a
limit that holds across connections (servers) taking at the same time."""

from __future__ import annotations

import threading

import pytest

from expresslane.server.database import connect
from expresslane.server.ratelimit import RateLimiter
from expresslane.server.shared_limits import SharedRateLimiter


def test_decisions_and_headers_match_the_in_memory_limiter(fresh_postgres):
    shared, local = SharedRateLimiter(connect(fresh_postgres)), RateLimiter()
    steps = [("take", 100)] * 4 + [("settle", 100, 20), ("take", 250), ("take", 400)]
    for step in steps:
        if step[0] == "settle":
            for limiter in (shared, local):
                limiter.settle("k", "default", *step[1:])
            continue
        a = shared.take("k", "default", 3, 600, step[1])
        b = local.take("k", "default", 3, 600, step[1])
        assert (a.allowed, a.limit) == (b.allowed, b.limit), step
        assert a.headers.keys() == b.headers.keys()
        for name in ("x-ratelimit-remaining-requests", "x-ratelimit-remaining-tokens"):
            assert abs(int(a.headers[name]) - int(b.headers[name])) <= 2, name
        assert abs(a.retry_after - b.retry_after) < 1
    assert shared.peek("k", "default", 3, 600).keys() == local.peek("k", "default", 3, 600).keys()
    refused = shared.take("k", "default", 3, 600, 1)
    assert not refused.allowed and refused.limit == "requests"
    assert int(refused.headers["retry-after"]) >= 1 and "retry-after-ms" in refused.headers


def test_no_limits_take_nothing_and_a_new_plan_starts_full(fresh_postgres):
    limiter = SharedRateLimiter(connect(fresh_postgres))
    assert limiter.take("k", "flex", None, None, 10**9).allowed
    assert limiter.peek("k", "flex", None, None) == {}
    assert limiter.take("k", "default", 1, None, 5).allowed
    assert not limiter.take("k", "default", 1, None, 5).allowed
    raised = limiter.take("k", "default", 4, None, 5)  # the key's plan changed: full buckets
    assert raised.allowed and raised.headers["x-ratelimit-remaining-requests"] == "3"
    assert limiter.peek("k", "default", 4, None)["x-ratelimit-remaining-requests"] == "3"
    assert limiter.peek("other", "default", 4, 100)["x-ratelimit-remaining-tokens"] == "100"


def test_a_big_request_waits_for_a_full_bucket_and_settles(fresh_postgres):
    limiter = SharedRateLimiter(connect(fresh_postgres))
    assert limiter.take("k", "default", None, 100, 500).allowed  # full: it may go below zero
    refused = limiter.take("k", "default", None, 100, 10)
    assert not refused.allowed and refused.limit == "tokens"
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    limiter.settle("k", "default", 500, 40)  # it used 40 of the 500 estimated
    assert limiter.take("k", "default", None, 100, 10).allowed


@pytest.mark.parametrize("rpm", [6, 1])
def test_a_limit_holds_across_connections_taking_at_once(fresh_postgres, rpm):
    limiters = [SharedRateLimiter(connect(fresh_postgres)) for _ in range(4)]
    granted, start = [], threading.Barrier(len(limiters) * 2)

    def worker(limiter: SharedRateLimiter) -> None:
        start.wait()
        for _ in range(5):
            granted.append(limiter.take("key", "default", rpm, 1000, 10).allowed)

    threads = [threading.Thread(target=worker, args=(li,)) for li in limiters * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(granted) == 40
    assert rpm <= sum(granted) <= rpm + 1  # + what refills while they run (0.1/s at 6/min)
