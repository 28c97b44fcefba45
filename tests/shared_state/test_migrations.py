"""Versioned migrations: a fresh database gets every version, reopening applies none again,
processes opening one database at once migrate it once, a failed migration leaves nothing, and
files made before versions were recorded open with their data."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading

import pytest

from expresslane.server import keys, metering, shared_limits, store
from expresslane.server.database import connect
from expresslane.server.keys import KeyStore
from expresslane.server.metering import Ledger
from expresslane.server.migrations import Migration, applied, migrate
from expresslane.server.store import ResponseStore

COMPONENTS = {
    "keys": keys.MIGRATIONS,
    "ledger": metering.MIGRATIONS,
    "responses": store.MIGRATIONS,
}
LATEST = {name: list(range(1, len(m) + 1)) for name, m in COMPONENTS.items()}


def versions(target: str) -> dict[str, list[tuple[int, float]]]:
    db = connect(target)
    try:
        rows = db.execute(
            "SELECT component, version, applied_at FROM schema_migrations "
            "ORDER BY component, version"
        ).rows
    finally:
        db.close()
    out: dict[str, list] = {}
    for component, version, at in rows:
        out.setdefault(component, []).append((version, at))
    return out


def open_all(target: str) -> None:
    ResponseStore(target).close()
    db = connect(target)
    KeyStore(db), Ledger(db)
    if db.shared:
        shared_limits.SharedRateLimiter(db)
    db.close()


def test_a_fresh_database_gets_every_version_once(database):
    open_all(database)
    first = versions(database)
    want = dict(LATEST)
    if database.startswith("postgresql"):
        want["rate_limits"] = [1]
    assert {c: [v for v, _ in rows] for c, rows in first.items()} == want
    open_all(database)  # reopening applies nothing again
    assert versions(database) == first
    db = connect(database)
    assert all(migrate(db, name, m) == [] for name, m in COMPONENTS.items())
    db.close()


def test_databases_opened_at_once_are_migrated_once(database):
    errors, start = [], threading.Barrier(6)

    def opener() -> None:
        start.wait()
        try:
            open_all(database)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=opener) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    got = versions(database)
    assert all(len(got[c]) == len(set(got[c])) == len(v) for c, v in LATEST.items())


def test_a_failed_migration_leaves_nothing(database):
    db = connect(database)
    try:
        assert migrate(db, "fine", [Migration(1, ("CREATE TABLE fine (a INTEGER)",))]) == [1]
        broken = [Migration(1, ("CREATE TABLE half (a INTEGER)", "CREATE TABLE oops ("))]
        with pytest.raises(Exception):  # noqa: B017 - each driver has its own syntax error
            migrate(db, "broken", broken)
        assert applied(db, "broken") == [] and applied(db, "fine") == [1]
        assert db.columns("half") == set()
        assert migrate(db, "broken", [Migration(1, ("CREATE TABLE half (a INTEGER)",))]) == [1]
        assert db.columns("half") == {"a"}
        with pytest.raises(ValueError, match="numbered"):
            migrate(db, "gap", [Migration(2, ())])
    finally:
        db.close()


# The accounts file as releases before versioned migrations made it (keys.py, metering.py).
OLD_ACCOUNTS = """
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, hash TEXT NOT NULL UNIQUE, hint TEXT NOT NULL,
    plan TEXT NOT NULL, created_at REAL NOT NULL, revoked_at REAL
);
CREATE TABLE IF NOT EXISTS ledger (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, request_id TEXT NOT NULL,
    key_id TEXT NOT NULL, tier_requested TEXT NOT NULL, tier_served TEXT NOT NULL,
    model TEXT NOT NULL, status TEXT NOT NULL, input_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, queue_s REAL, ttft_s REAL,
    decode_s REAL, e2e_s REAL, cost REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_key_ts ON ledger (key_id, ts);
CREATE INDEX IF NOT EXISTS ledger_request ON ledger (request_id);
"""


def test_an_old_accounts_file_opens_with_its_keys_and_ledger(tmp_path):
    path = str(tmp_path / "accounts.sqlite")
    old = sqlite3.connect(path)
    old.executescript(OLD_ACCOUNTS)
    plan = json.dumps({"tiers": ["default"], "default_tier": "default", "limits": {}})
    secret = "el-old-secret"
    old.execute(
        "INSERT INTO api_keys VALUES ('key_old', 'carol', ?, 'el-old-s', ?, 1.0, NULL)",
        (hashlib.sha256(secret.encode()).hexdigest(), plan),
    )
    old.execute(
        "INSERT INTO ledger (ts, request_id, key_id, tier_requested, tier_served, model, "
        "status, input_tokens, cached_tokens, output_tokens, cost) "
        "VALUES (5.0, 'req_old', 'key_old', 'default', 'default', 'm', 'stop', 7, 0, 3, 0.5)"
    )
    old.commit()
    old.close()
    db = connect(path)
    found = KeyStore(db).lookup(secret)
    ledger = Ledger(db)
    assert found.name == "carol" and found.plan.tiers == ["default"]
    assert ledger.tokens_since("key_old", 0) == 10
    old_row = ledger.rows()[0]
    assert old_row["request_id"] == "req_old"
    assert (old_row["promise_kept"], old_row["refund"]) == (None, 0)  # columns added later
    db.close()
    got = versions(path)
    assert [v for v, _ in got["keys"]] == [1] and [v for v, _ in got["ledger"]] == [1, 2, 3, 4]


def test_an_old_store_file_gains_its_origin_columns_and_a_version(tmp_path):
    path = str(tmp_path / "responses.sqlite")
    old = sqlite3.connect(path)
    old.execute(store.SCHEMA)  # the table before owners: no origin columns
    old.execute(
        "INSERT INTO responses VALUES ('resp_old', 1.0, 1.0, 'completed', ?, '[]', '[]')",
        (json.dumps({"id": "resp_old", "status": "completed"}),),
    )
    old.commit()
    old.close()
    s = ResponseStore(path)
    try:
        assert s.get("resp_old", "local").response["status"] == "completed"
    finally:
        s.close()
    assert [v for v, _ in versions(path)["responses"]] == [1, 2]
