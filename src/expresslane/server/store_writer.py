"""Write-behind for the response store: one thread commits queued row writes in batches.

Writes are keyed by response id and carry the whole row (or None: delete), so a newer write of
the same response replaces one still waiting: a response progressing fast costs one row write
per batch, whatever its rate. Each batch is one transaction, in the order the ids were first
queued. Until a write is committed, `pending` answers reads with it.
"""

from __future__ import annotations

import logging
import sqlite3
import threading

log = logging.getLogger("expresslane.server")


class StoreWriter:
    def __init__(self, db: sqlite3.Connection, lock: threading.Lock, columns: tuple[str, ...]):
        self.db = db
        self._lock = lock  # guards `db` (shared with readers for ":memory:")
        self._upsert = (
            f"INSERT OR REPLACE INTO responses ({', '.join(columns)}) "
            f"VALUES ({', '.join('?' * len(columns))})"
        )
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
        with self._lock:
            self.db.execute("BEGIN")
            try:
                for response_id, row in batch.items():
                    if row is None:
                        self.db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
                    else:
                        self.db.execute(self._upsert, row)
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")
