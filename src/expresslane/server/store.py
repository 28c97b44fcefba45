"""The response store (SQLite): responses created with `store: true`, their input items, and
the conversation they end (the chat messages a `previous_response_id` continuation re-renders).

`":memory:"` keeps everything in memory (tests). Writes are small and run on the event loop
under a lock; the file uses WAL so readers never block it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass

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


@dataclass
class StoredResponse:
    response: dict
    input_items: list[dict]
    context: list[dict]  # chat messages up to and including this response's output


class ResponseStore:
    def __init__(self, path: str = ":memory:"):
        self.path = path
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        if path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(SCHEMA)
        self._lock = threading.Lock()

    def put(self, response: dict, input_items: list[dict], context: list[dict]) -> None:
        now = time.time()
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    response["id"],
                    response.get("created_at", now),
                    now,
                    response["status"],
                    json.dumps(response),
                    json.dumps(input_items),
                    json.dumps(context),
                ),
            )

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT response, input_items, context FROM responses WHERE id = ?",
                (response_id,),
            ).fetchone()
        if row is None:
            return None
        return StoredResponse(json.loads(row[0]), json.loads(row[1]), json.loads(row[2]))

    def delete(self, response_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
        return cur.rowcount > 0

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()
