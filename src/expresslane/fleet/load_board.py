"""`LoadBoard`: what every engine replica of the fleet has running, as it last reported it.

Each replica reports its queues and KV use about once a second (`report_loop`, a thread in the
replica) to one named Ray actor; `expresslane cluster status` reads the board through any
ingress replica, so the load it shows is the replicas' own, not one ingress replica's view.
A replica that stops reporting (dead or drained) drops off after `STALE_SECONDS`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import ray

from expresslane.fleet.names import shared_actor

log = logging.getLogger("expresslane.fleet")

BOARD_NAME = "expresslane-load-board"
REPORT_SECONDS = 1.0
STALE_SECONDS = 5.0


class LoadRecord:
    def __init__(self):
        self.loads: dict[tuple[str, str], tuple[float, dict]] = {}  # (pool, replica) -> ...

    def report(self, pool: str, replica: str, load: dict) -> None:
        self.loads[(pool, replica)] = (time.monotonic(), load)

    def pools(self, stale_seconds: float = STALE_SECONDS) -> dict[str, dict[str, dict]]:
        """pool -> replica -> its last load, for replicas heard from recently."""
        now, out = time.monotonic(), {}
        for (pool, replica), (stamp, load) in list(self.loads.items()):
            if now - stamp > stale_seconds:
                del self.loads[(pool, replica)]
            else:
                out.setdefault(pool, {})[replica] = load
        return out


LoadBoard = ray.remote(num_cpus=0)(LoadRecord)


def board():
    """The fleet's board (made by whoever asks first)."""
    return shared_actor(LoadBoard, BOARD_NAME)


def report_loop(pool: str, replica: str, load: Callable[[], dict], stop: threading.Event):
    """Start a thread reporting `load()` to the board until `stop` is set."""

    def run():
        target = None
        while not stop.wait(REPORT_SECONDS):
            try:
                target = target or board()
                target.report.remote(pool, replica, load())
            except Exception:  # noqa: BLE001  (the board went away: find it again next time)
                log.warning("could not report load to the fleet's board", exc_info=True)
                target = None

    thread = threading.Thread(target=run, name="expresslane-load-report", daemon=True)
    thread.start()
    return thread
