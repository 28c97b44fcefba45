"""Write-behind for the response store: one thread commits queued row writes in batches.

Writes are keyed by response id and carry the whole row (or None: delete), so a newer write of
the same response replaces one still waiting: a response progressing fast costs one row write
per batch, whatever its rate. Each batch is one transaction, in the order the ids were first
queued. Until a write is committed, `pending` answers reads with it. The same SQL runs on
SQLite and PostgreSQL (`database.py`).
"""

from __future__ import annotations

import logging
import threading

from expresslane.server.database import Database

log = logging.getLogger("expresslane.server")


def upsert(columns: tuple[str, ...]) -> str:
    """Insert a row, or replace the one with its id (`columns[0]`)."""
    updates = ", ".join(f"{c} = excluded.{c}" for c in columns[1:])
    return (
        f"INSERT INTO responses ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))}) "
        f"ON CONFLICT ({columns[0]}) DO UPDATE SET {updates}"
    )


class StoreWriter:
    def __init__(self, db: Database, columns: tuple[str, ...]):
        self.db = db  # its own connection (or, for ":memory:", the readers' one too)
        self._upsert = upsert(columns)
        self._cv = threading.Condition()
        self._queued: dict[str, tuple | None] = {}
        self._writing: dict[str, tuple | None] = {}
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="response-store", daemon=True)
        self._thread.start()

    def put(self, response_id: str, row: tuple | None) -> None:
        with self._cv:
            if self._closing:
                raise RuntimeError("the response store is closed")
            self._queued[response_id] = row
            self._cv.notify_all()

    def pending(self, response_id: str) -> tuple[bool, tuple | None]:
        """(True, row or None for a delete) if a write of this id is not committed yet."""
        with self._cv:
            for writes in (self._queued, self._writing):
                if response_id in writes:
                    return True, writes[response_id]
        return False, None

    def flush(self) -> None:
        with self._cv:
            while self._queued or self._writing:
                self._cv.wait()

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queued and not self._closing:
                    self._cv.wait()
                if not self._queued:
                    return
                self._writing, self._queued = self._queued, {}
            try:
                self._write(self._writing)
            except Exception:  # one bad batch must not stop the store
                log.exception("could not write %d stored response(s)", len(self._writing))
            with self._cv:
                self._writing = {}
                self._cv.notify_all()

    def _write(self, batch: dict[str, tuple | None]) -> None:
        with self.db.transaction():
            for response_id, row in batch.items():
                if row is None:
                    self.db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
                else:
                    self.db.execute(self._upsert, row)
