"""API keys, the ledger and the response store behave the same on SQLite and PostgreSQL; two
connections to one database (two servers) see each other's writes."""

from __future__ import annotations

import pytest

from expresslane.lanes import build_lanes
from expresslane.server.accounts import Accounts
from expresslane.server.database import connect
from expresslane.server.keys import KeyStore, Plan
from expresslane.server.metering import Ledger, LedgerRow, Prices
from expresslane.server.store import Origin, ResponseStore


def row(request_id: str, key_id: str = "key_a", status: str = "stop", **kw) -> LedgerRow:
    values = dict(
        request_id=request_id,
        key_id=key_id,
        tier_requested="default",
        tier_served="default",
        model="m",
        status=status,
        input_tokens=10,
        cached_tokens=4,
        output_tokens=5,
        queue_s=0.01,
        ttft_s=0.1,
        decode_s=0.5,
        e2e_s=0.6,
        cost=0.25,
    )
    return LedgerRow(**{**values, **kw})


def test_keys_create_lookup_list_revoke(database):
    keys = KeyStore(connect(database))
    assert not keys.has_keys()
    plan = Plan(tiers=["default", "flex"], limits={"default": {"rpm": 6}}, monthly_tokens=99)
    key, secret = keys.create("alice", plan)
    other, other_secret = keys.create("bob", Plan())
    found = keys.lookup(secret)
    assert found.id == key.id and found.owner == "key:alice"
    assert found.plan == plan and found.plan.limits_for("default").rpm == 6
    assert keys.lookup(secret + "x") is None
    twin = KeyStore(connect(database))  # another server's connection
    assert twin.has_keys() and twin.lookup(other_secret).name == "bob"
    assert [k.name for k in twin.list()] == ["alice", "bob"]
    assert twin.revoke("alice") == 1 and twin.revoke("alice") == 0
    assert keys.lookup(secret) is None and keys.lookup(other_secret) is not None
    assert keys.revoke(other.id) == 1
    assert all(k.revoked_at is not None for k in keys.list())


def test_ledger_record_record_once_and_usage(database):
    ledger = Ledger(connect(database))
    assert ledger.record_once(row("r1"))
    assert ledger.record_once(row("r1-1"))  # a request's second choice: its own id
    assert ledger.record_once(row("r2", status="abort", ttft_s=None, decode_s=None, cost=0.0))
    assert ledger.record_once(row("r3", status="interrupted", queue_s=None, ttft_s=None))
    assert not ledger.record_once(row("r3", status="interrupted"))
    assert not ledger.record_once(row("r1", status="interrupted"))  # already billed
    assert not ledger.record_once(row("r1", status="stop"))  # whatever the order
    judged = {"promised_tokens_per_s": 50.0, "promised_ttft_s": 0.5, "promise_kept": 0}
    missed = row("r4", key_id="key_b", output_tokens=7, refund=1.25, missed="speed", **judged)
    assert ledger.record_once(missed)
    other = Ledger(connect(database))
    (a, b) = other.usage()
    assert a == {
        "key_id": "key_a",
        "tier": "default",
        "requests": 4,
        "cancelled": 1,
        "interrupted": 1,
        "input_tokens": 40,
        "cached_tokens": 16,
        "output_tokens": 20,
        "cost": pytest.approx(0.75),
        "mean_ttft_s": pytest.approx(0.1),
        "decode_tokens_per_s": pytest.approx(20 / 1.5),
        "promise_judged": 0,
        "promise_kept": 0,
        "refund": 0.0,
    }
    assert (b["key_id"], b["requests"], b["output_tokens"]) == ("key_b", 1, 7)
    assert (b["promise_judged"], b["promise_kept"], b["refund"]) == (1, 0, 1.25)
    (window,) = other.attainment(300.0)
    assert (window["key_id"], window["judged"], window["kept"]) == ("key_b", 1, 0)
    assert window["promised_tokens_per_s"] == 50.0 and window["refund"] == 1.25
    assert other.usage(since=2**40) == []
    assert other.tokens_since("key_a", 0) == 60 and other.tokens_since("nobody", 0) == 0
    rows = other.rows("r3")
    assert len(rows) == 1 and rows[0]["status"] == "interrupted" and rows[0]["queue_s"] is None
    assert [r["request_id"] for r in other.rows()] == ["r1", "r1-1", "r2", "r3", "r4"]
    assert other.rows("r4")[0]["missed"] == "speed"


def response(rid: str, status: str = "completed", text: str = "hi") -> dict:
    return {"id": rid, "status": status, "created_at": 1.0, "output": [{"text": text}]}


def test_store_put_get_ownership_delete(database):
    store = ResponseStore(database)
    try:
        alice = Origin("key:alice", "key_a", "flex", "default", "m", "req_1")
        store.put(response("r1"), [{"role": "user"}], [{"role": "assistant"}], alice)
        got = store.get("r1", "key:alice")  # readable at once, before it is committed
        assert got.response == response("r1") and got.origin == alice
        assert got.input_items == [{"role": "user"}] and got.context == [{"role": "assistant"}]
        assert store.get("r1", "key:bob") is None and store.get("r1").owner == "key:alice"
        for i in range(20):  # the latest state wins
            store.put(response("r2", "in_progress", f"t{i}"), [], [])
        store.put(response("r2", "completed", "final"), [], [])
        store.put(response("r3", "queued"), [], [], alice)
        store.flush()
        assert len(store) == 3
        assert store.get("r2").response["output"][0]["text"] == "final"
        assert [s.response["id"] for s in store.unfinished(idle_seconds=0)] == ["r3"]
        assert not store.delete("r1", "key:bob") and store.delete("r1", "key:alice")
        assert store.get("r1") is None
    finally:
        store.close()
    reopened = ResponseStore(database)  # committed: another process (or a restart) sees it
    try:
        assert reopened.get("r1") is None and len(reopened) == 2
        assert reopened.get("r3", "key:alice").origin == alice
    finally:
        reopened.close()


def test_two_stores_on_one_database_share_responses(database):
    a, b = ResponseStore(database), ResponseStore(database)
    try:
        a.put(response("shared"), [], [{"role": "user", "content": "x"}], Origin("key:z"))
        a.flush()
        assert b.get("shared", "key:z").context == [{"role": "user", "content": "x"}]
        assert b.get("shared", "local") is None
        b.delete("shared", "key:z")
        b.flush()
        assert a.get("shared") is None
    finally:
        a.close()
        b.close()


def test_shared_database_recovers_only_idle_unfinished_responses(fresh_postgres):
    """Another server may be running a fresh unfinished response: a starting server leaves it
    alone, and recovers one nobody has saved for a long time."""
    store = ResponseStore(fresh_postgres)
    try:
        store.put(response("live", "in_progress"), [], [])
        store.flush()
        assert store.unfinished() == []
        assert [s.response["id"] for s in store.unfinished(idle_seconds=0)] == ["live"]
    finally:
        store.close()


def test_accounts_on_postgres_use_the_shared_limiter(fresh_postgres, tmp_path):
    from expresslane.server.ratelimit import RateLimiter
    from expresslane.server.shared_limits import SharedRateLimiter

    shared = Accounts(fresh_postgres, Prices(), build_lanes(None))
    local = Accounts(str(tmp_path / "a.sqlite"), Prices(), build_lanes(None))
    try:
        assert isinstance(shared.limiter, SharedRateLimiter)
        assert type(local.limiter) is RateLimiter
    finally:
        shared.close()
        local.close()


def test_a_lost_connection_is_replaced_on_the_next_statement(fresh_postgres):
    """After the database restarts (or drops the session) the statement in flight fails, and
    the next one runs on a new connection."""
    keys = KeyStore(connect(fresh_postgres))
    pid = keys.db.execute("SELECT pg_backend_pid()").one()[0]
    admin = connect(fresh_postgres)
    assert admin.execute("SELECT pg_terminate_backend(?)", (pid,)).one() == (True,)
    admin.close()
    with pytest.raises(Exception):  # noqa: B017 - psycopg's OperationalError
        keys.has_keys()
    key, secret = keys.create("after", Plan())
    assert keys.lookup(secret).id == key.id


def test_sealed_text_opens_on_every_server_of_the_database_for_its_owner(database):
    from expresslane.server.errors import APIError
    from expresslane.server.sealing import Sealer

    one, two = Sealer.of_database(connect(database)), Sealer.of_database(connect(database))
    token = one.seal("key:alice", "thought")
    assert two.open("key:alice", token, "input[0]") == "thought"  # one key per database
    for owner, bad in (("key:bob", token), ("key:alice", token[:-4] + "AAAA")):
        with pytest.raises(APIError) as e:
            two.open(owner, bad, "input[0].encrypted_content")
        assert e.value.code == "invalid_encrypted_content"
