"""Write-behind for the response store: one thread commits queued row writes in batches.

Writes are keyed by response id and carry the whole row (or None: delete), so a newer write of
the same response replaces one still waiting: a response progressing fast costs one row write
per batch, whatever its rate. Each batch is one transaction, in the order the ids were first
queued. Until a write is committed, `pending` answers reads with it. The same SQL runs on
SQLite and PostgreSQL (`database.py`).

Batches are numbered: `put` answers the number of the batch its write will be committed in,
and `committed(batch)` waits (on the event loop) until that batch is. A request that must not
be acknowledged before its row is durable awaits it; writes that arrive while a batch commits
share the next one (group commit), so the cost of waiting stays one commit, not one per write.
"""

from __future__ import annotations

import asyncio
import contextlib
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
        self._open = 1  # the batch that writes put now go into
        self._done = 0  # the last batch that ended (committed or failed)
        self._failed: set[int] = set()
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._thread = threading.Thread(target=self._run, name="response-store", daemon=True)
        self._thread.start()

    def put(self, response_id: str, row: tuple | None) -> int:
        """Queue the write; answers its batch number (see `committed`)."""
        with self._cv:
            if self._closing:
                raise RuntimeError("the response store is closed")
            self._queued[response_id] = row
            self._cv.notify_all()
            return self._open

    async def committed(self, batch: int) -> None:
        """Return once `batch` is committed; raise if its transaction failed."""
        with self._cv:
            if self._done < batch:
                fut = asyncio.get_running_loop().create_future()
                self._waiters.append((batch, asyncio.get_running_loop(), fut))
            else:
                fut = None
        if fut is not None:
            await fut
        if batch in self._failed:
            raise RuntimeError("the response store could not commit this write")

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
                batch, self._open = self._open, self._open + 1
            try:
                self._write(self._writing)
            except Exception:  # one bad batch must not stop the store
                log.exception("could not write %d stored response(s)", len(self._writing))
                self._failed = {b for b in self._failed if b > batch - 1000} | {batch}
            with self._cv:
                self._writing = {}
                self._done = batch
                self._wake(batch)
                self._cv.notify_all()

    def _wake(self, batch: int) -> None:
        ready = [w for w in self._waiters if w[0] <= batch]
        self._waiters = [w for w in self._waiters if w[0] > batch]
        for _, loop, fut in ready:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
                loop.call_soon_threadsafe(_resolve, fut)

    def _write(self, batch: dict[str, tuple | None]) -> None:
        with self.db.transaction():
            for response_id, row in batch.items():
                if row is None:
                    self.db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
                else:
                    self.db.execute(self._upsert, row)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():  # its waiter may have been cancelled
        fut.set_result(None)
