"""What every replica and router of the fleet shares, in one named Ray actor (`records()`):
each pool's `PrefixRecord` (which replica each prompt block last went to, for router.py:
`SharedPrefixes`, or `LocalPrefixes` where one ingress replica routes alone) and the
`LoadRecord` (what each engine replica last reported running, for load_board.py and
`expresslane cluster status`).

One actor rather than one per pool and one for loads: an idle Ray actor costs 6-9 ms of CPU
a second (its core worker's timers), which a busy fleet pays per streamed token
(BENCHMARKS.md, "The fleet's token path"). Both records are plain Python, tested without Ray.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import ray

from expresslane.fleet.names import shared_actor

RECORDS_NAME = "expresslane-records"
MAX_BLOCKS = 200_000  # remembered block owners per pool (LRU); ~40 bytes of hash each
STALE_SECONDS = 5.0  # a replica not heard from for this long drops off the load record


class PrefixRecord:
    """Which replica each prompt block of one pool last went to. Shared by every ingress
    replica's router, so a conversation continued through another ingress replica still finds
    its replica."""

    def __init__(self):
        self.owners: OrderedDict[str, str] = OrderedDict()

    def owner_depths(self, hashes: list[str]) -> dict[str, int]:
        """For each replica, how many leading blocks its deepest recorded block covers. The
        blocks found count as used (a request routed to their owner is not recorded again)."""
        depths: dict[str, int] = {}
        for depth, h in enumerate(hashes, start=1):
            owner = self.owners.get(h)
            if owner is not None:
                depths[owner] = depth
                self.owners.move_to_end(h)
        return depths

    def record(self, hashes: list[str], replica: str) -> None:
        for h in hashes:
            self.owners[h] = replica
            self.owners.move_to_end(h)
        while len(self.owners) > MAX_BLOCKS:
            self.owners.popitem(last=False)


class LocalPrefixes(PrefixRecord):
    """A pool's record in its router's own process: enough where the fleet has one ingress
    replica (one router per pool), and no Ray call per request (each cost ~1 ms of CPU in the
    records actor, and as much again in the router's thread)."""

    async def depths(self, hashes: list[str]) -> dict[str, int]:
        return self.owner_depths(hashes)


class SharedPrefixes:
    """A pool's record in the records actor, shared by the routers of several ingress
    replicas."""

    def __init__(self, pool: str):
        self.pool = pool
        self.actor = records()

    async def depths(self, hashes: list[str]) -> dict[str, int]:
        return await self.actor.owner_depths.remote(self.pool, hashes)

    def record(self, hashes: list[str], replica: str) -> None:
        self.actor.record.remote(self.pool, hashes, replica)


class LoadRecord:
    """The last load each engine replica reported; replicas that stop reporting drop off."""

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


class FleetRecords:
    """The shared actor's class: the records above, by pool."""

    def __init__(self):
        self.prefixes: dict[str, PrefixRecord] = {}
        self.loads = LoadRecord()

    def owner_depths(self, pool: str, hashes: list[str]) -> dict[str, int]:
        return self._prefixes(pool).owner_depths(hashes)

    def record(self, pool: str, hashes: list[str], replica: str) -> None:
        self._prefixes(pool).record(hashes, replica)

    def report(self, pool: str, replica: str, load: dict) -> None:
        self.loads.report(pool, replica, load)

    def pools(self, stale_seconds: float = STALE_SECONDS) -> dict[str, dict[str, dict]]:
        return self.loads.pools(stale_seconds)

    def _prefixes(self, pool: str) -> PrefixRecord:
        return self.prefixes.setdefault(pool, PrefixRecord())


SharedRecords = ray.remote(num_cpus=0)(FleetRecords)


def records():
    """The fleet's records actor (made by whoever asks first)."""
    return shared_actor(SharedRecords, RECORDS_NAME)
