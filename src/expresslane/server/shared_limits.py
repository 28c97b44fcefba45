"""Requests/min and tokens/min held across every server that shares a PostgreSQL database.

The token buckets of `ratelimit.py`, kept in a row per (key, tier): the limits they are for,
both levels and when they were last refilled, by the database's clock (servers' clocks may
differ; the database has one). A request's take is one statement, an upsert whose update
refills both buckets from the stored time and takes from both only if both have enough, so
two servers taking at once are serialized by the row lock and never both spend the last
request. A plan whose limits changed starts from full buckets, as in memory. The decision and
its headers are `ratelimit.decide`'s, so a refusal looks the same from any server.
"""

from __future__ import annotations

from expresslane.server.database import Database
from expresslane.server.migrations import Migration, migrate
from expresslane.server.ratelimit import Bucket, Decision, decide, headers

TABLE = """
CREATE TABLE IF NOT EXISTS rate_limits (
    key_id TEXT NOT NULL,
    tier TEXT NOT NULL,
    rpm INTEGER,
    tpm INTEGER,
    requests REAL,
    tokens REAL,
    stamp REAL NOT NULL,
    granted BOOLEAN NOT NULL,
    PRIMARY KEY (key_id, tier)
)
"""
MIGRATIONS = [Migration(1, (TABLE,))]
NOW = "CAST(EXTRACT(EPOCH FROM statement_timestamp()) AS DOUBLE PRECISION)"


def _refilled(level: str, cap: str, old_cap: str, now: str, stamp: str) -> str:
    """SQL: the bucket `level` (limit `cap`) refilled until `now`; full if its limit changed
    from `old_cap`; NULL without a limit."""
    return (
        f"(CASE WHEN {cap} IS NULL THEN NULL "
        f"WHEN {old_cap} IS DISTINCT FROM {cap} THEN CAST({cap} AS DOUBLE PRECISION) "
        f"ELSE LEAST({cap}, {level} + GREATEST({now} - {stamp}, 0) * {cap} / 60.0) END)"
    )


_R = _refilled("b.requests", "excluded.rpm", "b.rpm", "excluded.stamp", "b.stamp")
_T = _refilled("b.tokens", "excluded.tpm", "b.tpm", "excluded.stamp", "b.stamp")
_AMOUNT = "CAST(:tokens AS DOUBLE PRECISION)"
_REQUESTS = "CAST(:requests AS DOUBLE PRECISION)"
_OK = (
    f"((excluded.rpm IS NULL OR {_R} >= LEAST({_REQUESTS}, excluded.rpm)) "
    f"AND (excluded.tpm IS NULL OR {_T} >= LEAST({_AMOUNT}, excluded.tpm)))"
)
TAKE = f"""
INSERT INTO rate_limits AS b (key_id, tier, rpm, tpm, requests, tokens, stamp, granted)
VALUES (:key, :tier, CAST(:rpm AS INTEGER), CAST(:tpm AS INTEGER),
        CAST(:rpm AS INTEGER) - {_REQUESTS}, CAST(:tpm AS INTEGER) - {_AMOUNT}, {NOW}, TRUE)
ON CONFLICT (key_id, tier) DO UPDATE SET
    requests = {_R} - CASE WHEN {_OK} THEN {_REQUESTS} ELSE 0 END,
    tokens = {_T} - CASE WHEN {_OK} THEN {_AMOUNT} ELSE 0 END,
    rpm = excluded.rpm, tpm = excluded.tpm, stamp = excluded.stamp, granted = {_OK}
RETURNING requests, tokens, granted
"""
_SETTLE_R = _refilled("requests", "rpm", "rpm", "c.now", "stamp")
_SETTLE_T = _refilled("tokens", "tpm", "tpm", "c.now", "stamp")
SETTLE = f"""
UPDATE rate_limits SET
    requests = {_SETTLE_R},
    tokens = LEAST(tpm, {_SETTLE_T} + CAST(:delta AS DOUBLE PRECISION)),
    stamp = c.now
FROM (SELECT {NOW} AS now) AS c
WHERE key_id = :key AND tier = :tier AND tpm IS NOT NULL
"""
PEEK = f"""
SELECT rpm, tpm, requests, tokens, GREATEST({NOW} - stamp, 0) FROM rate_limits
WHERE key_id = :key AND tier = :tier
"""


def _bucket(per_minute: int | None, level: float | None = None, plus: float = 0) -> Bucket | None:
    """A bucket at `level` + `plus` (full if `level` is None); None without a limit."""
    if per_minute is None:
        return None
    return Bucket(per_minute, None if level is None else level + plus)


class SharedRateLimiter:
    """`RateLimiter`'s interface, over the `rate_limits` table of a PostgreSQL database."""

    def __init__(self, db: Database):
        self.db = db
        migrate(db, "rate_limits", MIGRATIONS)

    def take(
        self,
        key_id: str,
        tier: str,
        rpm: int | None,
        tpm: int | None,
        tokens: int,
        requests: int = 1,
    ) -> Decision:
        """Take `requests` and `tokens` if both are available, else refuse (nothing taken)."""
        if rpm is None and tpm is None:
            return Decision(True, 0.0, {})
        params = {"key": key_id, "tier": tier, "rpm": rpm, "tpm": tpm, "tokens": tokens}
        params["requests"] = requests
        left, tokens_left, granted = self.db.execute(TAKE, params).one()
        back = 1 if granted else 0  # decide sees the levels from before this take
        buckets = {
            "requests": (_bucket(rpm, left, requests * back), requests),
            "tokens": (_bucket(tpm, tokens_left, tokens * back), tokens),
        }
        return decide(buckets, allowed=granted)

    def peek(self, key_id: str, tier: str, rpm: int | None, tpm: int | None) -> dict[str, str]:
        """The `x-ratelimit-*` headers of a key's buckets as they stand, taking nothing."""
        row = self.db.execute(PEEK, {"key": key_id, "tier": tier}).one()
        buckets = {}
        for i, (kind, cap) in enumerate((("requests", rpm), ("tokens", tpm))):
            b = _bucket(cap)  # full, unless the row has this limit's level
            if b is not None and row is not None and row[i] == cap:
                b.level = min(b.capacity, row[2 + i] + row[4] * b.rate)
            buckets[kind] = (b, 0)
        return headers(buckets)

    def settle(self, key_id: str, tier: str, estimated: int, used: int) -> None:
        """Correct a request's token estimate to what it really used."""
        if estimated != used:
            self.db.execute(SETTLE, {"key": key_id, "tier": tier, "delta": estimated - used})
