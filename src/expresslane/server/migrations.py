"""Versioned schema migrations, applied in order when a store opens its database.

Each store names its component (`keys`, `ledger`, `responses`, `rate_limits`) and lists its
migrations, numbered from 1; `schema_migrations` records which (component, version) a
database has and when each was applied, so reopening applies nothing twice. A migration is a
list of steps: DDL written as SQLite spells it (`Database.ddl` translates it for PostgreSQL),
or a function of the database for what SQL alone cannot say.

Version 1 of each component is the schema as it was before versions were recorded, written to
adopt a file that already has it (`IF NOT EXISTS`, columns added only where missing), so files
made by older releases open with their data and are then versioned like new ones.

Migrating is one transaction, serialized between processes that open the same database at
once: SQLite takes its write lock first (BEGIN IMMEDIATE), PostgreSQL a transaction-level
advisory lock. DDL is transactional on both, so a failed migration leaves nothing half done.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from expresslane.server.database import Database

TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    component TEXT NOT NULL,
    version INTEGER NOT NULL,
    applied_at REAL NOT NULL,
    PRIMARY KEY (component, version)
)
"""
LOCK_KEY = 0x6578_7072_6573_73  # pg_advisory_xact_lock's key for migrating: "express"


@dataclass(frozen=True)
class Migration:
    version: int
    steps: tuple[str | Callable[[Database], None], ...]


def applied(db: Database, component: str) -> list[int]:
    """The versions of `component` this database has, in order."""
    rows = db.execute(
        "SELECT version FROM schema_migrations WHERE component = ? ORDER BY version",
        (component,),
    ).rows
    return [r[0] for r in rows]


def migrate(db: Database, component: str, migrations: list[Migration]) -> list[int]:
    """Apply the migrations of `component` the database lacks; returns the versions applied."""
    versions = [m.version for m in migrations]
    if versions != list(range(1, len(migrations) + 1)):
        raise ValueError(f"{component}: migrations must be numbered 1, 2, ...; got {versions}")
    done = []
    with db.transaction():
        if db.kind == "postgres":
            db.execute("SELECT pg_advisory_xact_lock(CAST(? AS BIGINT))", (LOCK_KEY,))
        db.execute(db.ddl(TABLE))
        have = set(applied(db, component))
        for m in migrations:
            if m.version in have:
                continue
            for step in m.steps:
                if callable(step):
                    step(db)
                else:
                    db.execute(db.ddl(step))
            db.execute(
                "INSERT INTO schema_migrations (component, version, applied_at) VALUES (?, ?, ?)",
                (component, m.version, time.time()),
            )
            done.append(m.version)
    return done
