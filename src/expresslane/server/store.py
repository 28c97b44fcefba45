"""The response store (SQLite, or PostgreSQL shared by a fleet's servers): responses created
with `store: true`, their input items, the conversation they end (the chat messages a
`previous_response_id` continuation re-renders), and who made them (owner, key, tiers, model,
request id: what ownership checks and billing after a crash need).

A response is written when it is created, again as it progresses and when it ends. Writes go
through `StoreWriter`, a thread that commits them in batches (latest state per response wins),
so no SQLite write or fsync runs on the event loop; reads see pending writes first, so a
response is readable the moment it is put. Files use WAL with `synchronous=FULL` on the writing
connection: a committed write survives `kill -9` (any synchronous setting does, in WAL) and
power loss too, and batching keeps the fsyncs to about one per batch. `":memory:"` keeps
everything in memory (tests). In PostgreSQL (`database.py`) the writer and the readers have a
connection each, and the batches are transactions there.

Old files gain the origin columns on open (migration 1); their rows belong to the local owner.
Each row also names the server instance that wrote it last (`server_id`, migration 2), whose
lease (`store_lease.py`) says whether it still runs: a starting server recovers only the
unfinished rows of owners that are gone.
"""

from __future__ import annotations

import json
import time
from dataclasses import astuple, dataclass, field, fields

from expresslane.server.database import Database, connect
from expresslane.server.keys import LOCAL_OWNER, OPEN_ACCESS_ID
from expresslane.server.migrations import Migration, migrate
from expresslane.server.store_lease import TABLE as LEASES
from expresslane.server.store_lease import StoreLease
from expresslane.server.store_writer import StoreWriter

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    status TEXT NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    context TEXT NOT NULL
)
"""
BASE_COLUMNS = ("id", "created_at", "updated_at", "status", "response", "input_items", "context")
UNFINISHED = ("queued", "in_progress")
# Rows written before owners were recorded (server_id ''): in a shared database one starting
# server recovers only those no server has saved for this long.
SHARED_IDLE_SECONDS = 600.0


@dataclass
class Origin:
    """Who made a stored response and how its tokens are billed."""

    owner: str = LOCAL_OWNER
    key_id: str = OPEN_ACCESS_ID
    tier_requested: str = "default"
    tier_served: str = "default"
    model: str = ""
    request_id: str = ""


ORIGIN_COLUMNS = tuple(f.name for f in fields(Origin))
COLUMNS = BASE_COLUMNS + ORIGIN_COLUMNS + ("server_id",)


@dataclass
class StoredResponse:
    response: dict
    input_items: list[dict]
    context: list[dict]  # chat messages up to and including this response's output
    origin: Origin = field(default_factory=Origin)
    server_id: str = ""  # the server instance that wrote it last ("": before owners were kept)

    @property
    def owner(self) -> str:
        return self.origin.owner


def _add_origin_columns(db: Database) -> None:
    """Add the origin columns a file made before them lacks (old rows get the defaults: the
    local owner)."""
    have = db.columns("responses")
    for f in fields(Origin):
        if f.name not in have:
            default = str(f.default).replace("'", "''")
            db.execute(
                f"ALTER TABLE responses ADD COLUMN {f.name} TEXT NOT NULL DEFAULT '{default}'"
            )


MIGRATIONS = [
    Migration(
        1,
        (
            SCHEMA,
            _add_origin_columns,
            "CREATE INDEX IF NOT EXISTS responses_status ON responses (status)",
        ),
    ),
    Migration(
        2,
        (LEASES, "ALTER TABLE responses ADD COLUMN server_id TEXT NOT NULL DEFAULT ''"),
    ),
]


def _decode(row: tuple) -> StoredResponse:
    values = dict(zip(COLUMNS, row, strict=True))
    return StoredResponse(
        json.loads(values["response"]),
        json.loads(values["input_items"]),
        json.loads(values["context"]),
        Origin(*(values[c] for c in ORIGIN_COLUMNS)),
        values["server_id"],
    )


class ResponseStore:
    def __init__(self, path: str = ":memory:"):
        """`path`: a SQLite file, `":memory:"` or a PostgreSQL URL."""
        self.path = path
        write_db = connect(path, synchronous="FULL")
        migrate(write_db, "responses", MIGRATIONS)
        if path == ":memory:":  # one database, shared by both sides
            self._read_db = write_db
        else:  # WAL: a reader never waits for the writer's fsync
            self._read_db = connect(path)
        self._writer = StoreWriter(write_db, COLUMNS)
        self.lease = StoreLease(self._read_db)

    def put(
        self,
        response: dict,
        input_items: list[dict],
        context: list[dict],
        origin: Origin | None = None,
    ) -> int:
        """Store the response as it is now (a snapshot: later changes to the dicts are not
        seen); readable at once, committed shortly after. Answers the write's batch:
        `await committed(batch)` returns once it is durable."""
        now = time.time()
        row = (
            response["id"],
            response.get("created_at", now),
            now,
            response["status"],
            json.dumps(response),
            json.dumps(input_items),
            json.dumps(context),
            *astuple(origin or Origin()),
            self.lease.server_id,
        )
        return self._writer.put(response["id"], row)

    def get(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        """The stored response, or None if there is none, or if `owner` is given and it is
        someone else's (the same answer, so ids of others cannot be probed)."""
        pending, row = self._writer.pending(response_id)
        if not pending:
            row = self._read_db.execute(
                f"SELECT {', '.join(COLUMNS)} FROM responses WHERE id = ?", (response_id,)
            ).one()
        if row is None:
            return None
        stored = _decode(row)
        if owner is not None and stored.owner != owner:
            return None
        return stored

    def delete(self, response_id: str, owner: str | None = None) -> int | None:
        """Delete the response; answers the write's batch (as `put`), or None if
        `get(response_id, owner)` would find none."""
        if self.get(response_id, owner) is None:
            return None
        return self._writer.put(response_id, None)

    async def committed(self, batch: int) -> None:
        """Return once the write of `batch` (from `put` or `delete`) is committed."""
        await self._writer.committed(batch)

    def unfinished(self, idle_seconds: float | None = None) -> list[StoredResponse]:
        """Responses left queued or in progress by servers that are gone (their leases are
        taken here: see `StoreLease.reap`), and those from before owners were kept that were
        not saved for `SHARED_IDLE_SECONDS` in a shared database. With `idle_seconds`: every
        unfinished response not saved for that long, whoever runs it."""
        self.flush()
        marks = ", ".join("?" * len(UNFINISHED))
        where = f"SELECT {', '.join(COLUMNS)} FROM responses WHERE status IN ({marks})"
        if idle_seconds is not None:
            sql, params = where + " AND updated_at <= ?", (time.time() - idle_seconds,)
        else:
            self.lease.reap()
            legacy = SHARED_IDLE_SECONDS if self._read_db.shared else 0.0
            sql = where + (
                " AND ((server_id = '' AND updated_at <= ?) OR (server_id <> '' AND "
                "server_id NOT IN (SELECT server_id FROM server_leases)))"
            )
            params = (time.time() - legacy,)
        rows = self._read_db.execute(sql, (*UNFINISHED, *params)).rows
        return [_decode(r) for r in rows]

    def flush(self) -> None:
        """Wait until every write put so far is committed."""
        self._writer.flush()

    def __len__(self) -> int:
        self.flush()
        return self._read_db.execute("SELECT COUNT(*) FROM responses").one()[0]

    def close(self) -> None:
        """Commit what is pending, then close."""
        self._writer.close()
        self.lease.close()
        self._read_db.close()
        if self._read_db is not self._writer.db:
            self._writer.db.close()
