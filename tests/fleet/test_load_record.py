"""The fleet's records: the last load each replica reported (silent replicas drop off), and
each pool's prefix record kept apart in the one shared object. Plain Python, no Ray cluster
needed."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray")

from expresslane.fleet.records import FleetRecords, LoadRecord  # noqa: E402


def test_last_report_per_replica_by_pool():
    record = LoadRecord()
    record.report("std", "a", {"running": 1})
    record.report("std", "a", {"running": 3})
    record.report("std", "b", {"running": 0})
    record.report("fast", "c", {"running": 2})
    assert record.pools() == {
        "std": {"a": {"running": 3}, "b": {"running": 0}},
        "fast": {"c": {"running": 2}},
    }


def test_a_replica_that_stops_reporting_drops_off():
    record = LoadRecord()
    record.report("std", "gone", {"running": 5})
    time.sleep(0.05)
    record.report("std", "alive", {"running": 1})
    assert record.pools(stale_seconds=0.03) == {"std": {"alive": {"running": 1}}}
    assert ("std", "gone") not in record.loads


def test_one_records_object_keeps_each_pools_prefixes_apart_and_the_loads():
    shared = FleetRecords()
    shared.record("std", ["h1", "h2"], "a")
    shared.record("fast", ["h1"], "b")
    assert shared.owner_depths("std", ["h1", "h2"]) == {"a": 2}
    assert shared.owner_depths("fast", ["h1", "h2"]) == {"b": 1}
    assert shared.owner_depths("flex", ["h1"]) == {}
    shared.report("std", "a", {"running": 1})
    assert shared.pools() == {"std": {"a": {"running": 1}}}
