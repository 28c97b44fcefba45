"""One owner per store: two real `expresslane serve` processes on the same SQLite files (the
default paths' case). The second one's start leaves the first one's running responses alone;
when the first is killed, the second recovers them (its sweep), and every request id has one
ledger row."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ..conftest import make_checkpoint
from .test_durability import Serve, create, ledger, saved, text_of, wait_until


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory) -> Path:
    """The tiny Llama with a 4096-token context: responses that run for seconds."""
    return make_checkpoint(
        tmp_path_factory.mktemp("long_ctx"), "llama", max_position_embeddings=4096
    )


def started(server: Serve, count: int) -> list[str]:
    """`count` long background responses, once each has saved some output."""
    ids = [create(server.http, background=True)["id"] for _ in range(count)]

    def progressed():
        rows = saved(server.store)
        return all(i in rows and text_of(rows[i]) for i in ids)

    wait_until(progressed, "every response to save progress")
    return ids


def test_a_second_server_does_not_recover_a_live_servers_responses(long_llama, tmp_path):
    first = Serve(long_llama, tmp_path)
    second = None
    try:
        ids = started(first, 2)
        second = Serve(long_llama, tmp_path)  # same store, same accounts file
        for rid in ids:
            assert saved(first.store)[rid]["status"] == "in_progress"
            assert second.http.get(f"/v1/responses/{rid}").json()["status"] == "in_progress"
            cancelled = first.http.post(f"/v1/responses/{rid}/cancel").json()
            assert cancelled["status"] == "cancelled"
    finally:
        first.stop(signal.SIGTERM)
        if second is not None:
            second.stop(signal.SIGTERM)
    rows = ledger(first.accounts)
    assert sorted(r[0] for r in rows) == sorted(ids)  # one row each: the owner's
    assert all(r[1] == "abort" for r in rows), rows


def test_a_killed_servers_responses_are_recovered_by_the_live_one_once(long_llama, tmp_path):
    first = Serve(long_llama, tmp_path)
    second = Serve(long_llama, tmp_path)
    try:
        ids = started(first, 2)
        first.stop(signal.SIGKILL)

        def recovered():
            return all(saved(first.store)[i]["status"] == "incomplete" for i in ids)

        wait_until(recovered, "the live server to recover the killed one's responses", 60)
        for rid in ids:
            r = second.http.get(f"/v1/responses/{rid}").json()
            assert r["incomplete_details"] == {"reason": "server_restarted"}
    finally:
        first.stop()
        second.stop(signal.SIGTERM)
    rows = ledger(first.accounts)
    assert sorted(r[0] for r in rows) == sorted(ids)
    assert all(r[1] == "interrupted" and r[3] > 0 for r in rows), rows
