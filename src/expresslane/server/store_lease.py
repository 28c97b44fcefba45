"""`StoreLease`: which server instance owns the unfinished responses of a store.

Each `ResponseStore` opened by a server is one owner: it writes a row in `server_leases` (its
id, its host, its process) and renews it every `HEARTBEAT_SECONDS` from a thread of its own,
so a busy event loop does not lose it. Every response row it writes carries its id. A
starting (or sweeping) server recovers only the unfinished rows whose owner is gone:

- its lease was not renewed for `LEASE_SECONDS` (a server on another host died, or hangs), or
- it ran on this host (same boot, same PID namespace) and its process is gone: a `kill -9`
  followed by a restart recovers at once, without waiting for the lease to run out.

Taking a dead owner's rows is one conditional DELETE of its lease row (the heartbeat seen must
still be there), so of two servers sweeping at once one recovers them. An owner whose lease
was taken (it stalled longer than the lease) finds its row gone at the next heartbeat and
says so in the log; the ledger's once-per-request index keeps it from billing again
(`durability.py`). The same SQL serves SQLite and PostgreSQL.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

from expresslane.server.database import Database

log = logging.getLogger("expresslane.server")

TABLE = """
CREATE TABLE IF NOT EXISTS server_leases (
    server_id TEXT PRIMARY KEY,
    host TEXT NOT NULL,
    process TEXT NOT NULL,
    started_at REAL NOT NULL,
    heartbeat_at REAL NOT NULL
)
"""
HEARTBEAT_SECONDS = 2.0
LEASE_SECONDS = 15.0


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def host_identity() -> str:
    """This host, as far as process ids mean the same thing: name, boot, PID namespace."""
    try:
        pid_ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pid_ns = ""
    boot = _read("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot}/{pid_ns}"


def process_identity(pid: int) -> str:
    """`pid:start time` (the start time tells a reused PID from the process that had it)."""
    stat = _read(f"/proc/{pid}/stat")
    start = stat.rsplit(")", 1)[-1].split()[19] if stat else ""
    return f"{pid}:{start}"


def process_alive(process: str) -> bool:
    pid = int(process.split(":", 1)[0])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return process_identity(pid) == process


class StoreLease:
    def __init__(self, db: Database):
        self.db = db
        self.server_id = f"srv_{uuid.uuid4().hex}"
        self.host = host_identity()
        self.lost = False
        now = time.time()
        db.execute(
            "INSERT INTO server_leases (server_id, host, process, started_at, heartbeat_at) "
            "VALUES (?, ?, ?, ?, ?)",
            (self.server_id, self.host, process_identity(os.getpid()), now, now),
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="store-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                self.renew()
            except Exception:  # a database hiccup: the next beat tries again
                log.exception("could not renew the response store's lease")

    def renew(self) -> None:
        renewed = self.db.execute(
            "UPDATE server_leases SET heartbeat_at = ? WHERE server_id = ?",
            (time.time(), self.server_id),
        ).rowcount
        if renewed == 0 and not self.lost:
            self.lost = True
            log.error(
                "another server took this server's response-store lease (it was not renewed "
                "for %.0f s): its unfinished responses were marked interrupted there",
                LEASE_SECONDS,
            )

    def reap(self) -> list[str]:
        """Delete the leases of owners that are gone; answers their ids (this caller won
        them: it recovers their rows)."""
        rows = self.db.execute(
            "SELECT server_id, host, process, heartbeat_at FROM server_leases WHERE server_id <> ?",
            (self.server_id,),
        ).rows
        stale = time.time() - LEASE_SECONDS
        won = []
        for server_id, host, process, heartbeat in rows:
            gone = heartbeat < stale or (host == self.host and not process_alive(process))
            if gone and self._take(server_id, heartbeat):
                won.append(server_id)
        return won

    def _take(self, server_id: str, heartbeat: float) -> bool:
        return (
            self.db.execute(
                "DELETE FROM server_leases WHERE server_id = ? AND heartbeat_at = ?",
                (server_id, heartbeat),
            ).rowcount
            == 1
        )

    def close(self) -> None:
        """Stop renewing and give the lease up (whatever this owner left is anyone's)."""
        self._stop.set()
        self._thread.join()
        self.db.execute("DELETE FROM server_leases WHERE server_id = ?", (self.server_id,))
