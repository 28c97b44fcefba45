"""The load board: each engine replica reports its queues and KV use about once a second
(`report_loop`, a thread in the replica) to the fleet's records actor (records.py:
`LoadRecord`); `expresslane cluster status` reads it through any ingress replica, so the load
it shows is the replicas' own, not one ingress replica's view. A replica that stops reporting
(dead or drained) drops off after `records.STALE_SECONDS`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from expresslane.fleet.records import records

log = logging.getLogger("expresslane.fleet")

REPORT_SECONDS = 1.0


def report_loop(pool: str, replica: str, load: Callable[[], dict], stop: threading.Event):
    """Start a thread reporting `load()` to the board until `stop` is set."""

    def run():
        target = None
        while not stop.wait(REPORT_SECONDS):
            try:
                target = target or records()
                target.report.remote(pool, replica, load())
            except Exception:  # noqa: BLE001  (the board went away: find it again next time)
                log.warning("could not report load to the fleet's board", exc_info=True)
                target = None

    thread = threading.Thread(target=run, name="expresslane-load-report", daemon=True)
    thread.start()
    return thread
