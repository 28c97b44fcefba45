"""Metering: one ledger row per finished, cancelled or interrupted request, priced per tier.
(Interrupted: a stored response the server stopped, by a crash or at the end of a graceful
stop, billed for the tokens it had generated.)

cost = (uncached input × input price + cached input × cached-input price + output × output
price) / 1M × the serving lane's price multiplier (e.g. ultrafast 6×, flex 0.5×). Prices come
from the `[prices]` table of the config file. `expresslane usage` sums the ledger per key and
tier. The ledger lives in the accounts database (`database.py`: SQLite, or PostgreSQL shared
by a fleet's servers).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, fields

from expresslane.server.database import Database
from expresslane.server.migrations import Migration, migrate

TABLE = """
CREATE TABLE IF NOT EXISTS ledger (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    request_id TEXT NOT NULL,
    key_id TEXT NOT NULL,
    tier_requested TEXT NOT NULL,
    tier_served TEXT NOT NULL,
    model TEXT NOT NULL,
    status TEXT NOT NULL,
    input_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    queue_s REAL,
    ttft_s REAL,
    decode_s REAL,
    e2e_s REAL,
    cost REAL NOT NULL
)
"""
MIGRATIONS = [
    Migration(
        1,
        (
            TABLE,
            "CREATE INDEX IF NOT EXISTS ledger_key_ts ON ledger (key_id, ts)",
            "CREATE INDEX IF NOT EXISTS ledger_request ON ledger (request_id)",
        ),
    ),
    # An interrupted request is billed once even when two servers recover it at the same time.
    Migration(
        2,
        (
            "CREATE UNIQUE INDEX IF NOT EXISTS ledger_interrupted_once ON ledger (request_id) "
            "WHERE status = 'interrupted'",
        ),
    ),
    # A lane's promise (promise.py): what was promised and delivered, a miss's refund.
    Migration(
        3,
        tuple(
            f"ALTER TABLE ledger ADD COLUMN {column}"
            for column in (
                "promised_tokens_per_s REAL",
                "promised_ttft_s REAL",
                "delivered_tokens_per_s REAL",
                "promise_kept INTEGER",
                "refund REAL NOT NULL DEFAULT 0",
            )
        ),
    ),
    # One row per request id whatever its status (rows a second server wrote for the same
    # request before this index existed are dropped, the first kept); why a promise was missed.
    Migration(
        4,
        (
            "DELETE FROM ledger WHERE id NOT IN (SELECT MIN(id) FROM ledger GROUP BY request_id)",
            "DROP INDEX IF EXISTS ledger_interrupted_once",
            "CREATE UNIQUE INDEX IF NOT EXISTS ledger_request_once ON ledger (request_id)",
            "ALTER TABLE ledger ADD COLUMN missed TEXT",
            "ALTER TABLE ledger ADD COLUMN refund_withheld TEXT",
        ),
    ),
]
# INSERT ... SELECT's values get no type from the columns in PostgreSQL (a NULL would be text)
CASTS = {"str": "TEXT", "int": "INTEGER", "float": "DOUBLE PRECISION"}


@dataclass
class Prices:
    """Base prices per 1M tokens (the default lane's; other lanes multiply them)."""

    input_per_1m: float = 0.10
    cached_input_per_1m: float = 0.025
    output_per_1m: float = 0.40
    currency: str = "USD"

    @classmethod
    def from_table(cls, table: dict | None) -> Prices:
        table = dict(table or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(f"unknown [prices] setting(s) {unknown}; known: {sorted(known)}")
        return cls(**table)

    def cost(self, input_tokens: int, cached: int, output: int, multiplier: float) -> float:
        base = (
            (input_tokens - cached) * self.input_per_1m
            + cached * self.cached_input_per_1m
            + output * self.output_per_1m
        )
        return base / 1e6 * multiplier


@dataclass
class LedgerRow:
    request_id: str
    key_id: str
    tier_requested: str
    tier_served: str
    model: str
    status: str  # finish reason: stop, length, abort (cancelled), error, interrupted (restart)
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    queue_s: float | None
    ttft_s: float | None
    decode_s: float | None
    e2e_s: float | None
    cost: float  # what is billed, the refund taken off
    # on a lane with a promise, for a finished request (None elsewhere)
    promised_tokens_per_s: float | None = None
    promised_ttft_s: float | None = None  # for this request's prompt length
    delivered_tokens_per_s: float | None = None
    promise_kept: int | None = None  # 1 kept, 0 missed
    refund: float = 0.0
    missed: str | None = None  # what the promise missed: "ttft" or "speed"
    # a miss not refunded, and why: "own_backlog", "queued_without_room" (accounts.Ticket)
    refund_withheld: str | None = None


def month_start(now: float | None = None) -> float:
    t = time.gmtime(now if now is not None else time.time())
    return time.mktime((t.tm_year, t.tm_mon, 1, 0, 0, 0, 0, 0, 0)) - time.timezone


NAMES = [f.name for f in fields(LedgerRow)]
INSERT = f"INSERT INTO ledger (ts, {', '.join(NAMES)}) "
RECORD_ONCE = (
    INSERT
    + "SELECT CAST(? AS DOUBLE PRECISION), "
    + ", ".join(f"CAST(? AS {CASTS[f.type.split(' ')[0]]})" for f in fields(LedgerRow))
    + " WHERE NOT EXISTS (SELECT 1 FROM ledger WHERE request_id = ?) ON CONFLICT DO NOTHING"
)


class Ledger:
    def __init__(self, db: Database):
        self.db = db
        migrate(db, "ledger", MIGRATIONS)

    def record_once(self, row: LedgerRow) -> bool:
        """Write the row unless the ledger already has one for its request id (one statement,
        and a unique index: however two writers race, a request is billed once); True if it
        was written."""
        values = [getattr(row, n) for n in NAMES]
        result = self.db.execute(RECORD_ONCE, [time.time(), *values, row.request_id])
        return result.rowcount == 1

    def tokens_since(self, key_id: str, since: float) -> int:
        (total,) = self.db.execute(
            "SELECT COALESCE(SUM(input_tokens + output_tokens), 0) FROM ledger "
            "WHERE key_id = ? AND ts >= ?",
            (key_id, since),
        ).one()
        return int(total)

    def usage(self, since: float | None = None) -> list[dict]:
        """Totals per key and served tier."""
        rows = self.db.execute(
            "SELECT key_id, tier_served, COUNT(DISTINCT request_id), "
            "SUM(CASE WHEN status = 'abort' THEN 1 ELSE 0 END), "
            "SUM(CASE WHEN status = 'interrupted' THEN 1 ELSE 0 END), SUM(input_tokens), "
            "SUM(cached_tokens), SUM(output_tokens), SUM(cost), AVG(ttft_s), "
            "SUM(output_tokens) / NULLIF(SUM(decode_s), 0), COUNT(promise_kept), "
            "COALESCE(SUM(promise_kept), 0), SUM(refund) "
            "FROM ledger WHERE ts >= ? GROUP BY key_id, tier_served "
            "ORDER BY key_id, tier_served",
            (since or 0.0,),
        ).rows
        cols = [
            "key_id",
            "tier",
            "requests",
            "cancelled",
            "interrupted",
            "input_tokens",
            "cached_tokens",
            "output_tokens",
            "cost",
            "mean_ttft_s",
            "decode_tokens_per_s",
            "promise_judged",
            "promise_kept",
            "refund",
        ]
        return [dict(zip(cols, r, strict=True)) for r in rows]

    def attainment(self, window_s: float, since: float | None = None) -> list[dict]:
        """How each key's requests kept their tier's promise, per window of `window_s`
        seconds: judged, kept, the delivered speed's median and the promised one, refunds."""
        rows = self.db.execute(
            "SELECT key_id, tier_served, ts, promise_kept, delivered_tokens_per_s, "
            "promised_tokens_per_s, refund FROM ledger "
            "WHERE promise_kept IS NOT NULL AND ts >= ? ORDER BY ts",
            (since or 0.0,),
        ).rows
        groups: dict[tuple, list] = {}
        for key, tier, ts, kept, delivered, promised, refund in rows:
            start = ts - ts % window_s
            groups.setdefault((key, tier, start), []).append((kept, delivered, promised, refund))
        return [
            _window_row(key, tier, start, window_s, g) for (key, tier, start), g in groups.items()
        ]

    def rows(self, request_id: str | None = None) -> list[dict]:
        result = self.db.execute(
            "SELECT * FROM ledger"
            + (" WHERE request_id LIKE ? ORDER BY id" if request_id else " ORDER BY id"),
            (request_id + "%",) if request_id else (),
        )
        return [dict(zip(result.columns, r, strict=True)) for r in result.rows]


def _window_row(key: str, tier: str, start: float, window_s: float, rows: list) -> dict:
    speeds = sorted(d for _, d, _, _ in rows if d is not None)
    return {
        "key_id": key,
        "tier": tier,
        "window_start": start,
        "window_s": window_s,
        "judged": len(rows),
        "kept": sum(k for k, _, _, _ in rows),
        "attainment": sum(k for k, _, _, _ in rows) / len(rows),
        "median_delivered_tokens_per_s": statistics.median(speeds) if speeds else None,
        "promised_tokens_per_s": rows[-1][2],
        "refund": sum(r for _, _, _, r in rows),
    }
