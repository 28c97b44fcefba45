"""`InFlight`: the generations a server admitted and that have not ended, counted per lane, per
key, and per key within each lane; `QueueLimits`: the bounds `accounts.py` checks them against.
A generation counts from admission (before its prompt is tokenized) until its ledger row is
written, so concurrent requests see each other's reservations."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from expresslane.lanes import Lane, queue_capacity


class InFlight:
    def __init__(self):
        self._lanes: Counter[str] = Counter()
        self._keys: Counter[str] = Counter()
        self._key_lanes: Counter[tuple[str, str]] = Counter()

    def lane(self, lane: str) -> int:
        return self._lanes[lane]

    def key(self, key_id: str) -> int:
        return self._keys[key_id]

    def key_lane(self, key_id: str, lane: str) -> int:
        return self._key_lanes[key_id, lane]

    def add(self, key_id: str, lane: str, n: int = 1) -> None:
        self._lanes[lane] += n
        self._keys[key_id] += n
        self._key_lanes[key_id, lane] += n

    def remove(self, key_id: str, lane: str, n: int = 1) -> None:
        for counter, name in (
            (self._lanes, lane),
            (self._keys, key_id),
            (self._key_lanes, (key_id, lane)),
        ):
            left = counter[name] - n
            if left > 0:
                counter[name] = left
            else:
                del counter[name]


@dataclass
class QueueLimits:
    """How much work may wait: per lane beyond its max batch (None: as many again as its max
    batch) and per key (running or waiting, all tiers; None: unbounded). Within a lane one key
    may hold its `key_share` of the lane's queue."""

    per_lane: int | None = None
    per_key: int | None = 256

    def lane_capacity(self, lane: Lane) -> int:
        return queue_capacity(lane, self.per_lane)

    def key_capacity(self, lane: Lane, shared: bool = True) -> int:
        """Generations of one key a lane may hold, running or waiting (`shared`: with other
        keys; else all of it)."""
        share = lane.key_share if shared else 1.0
        return max(1, math.ceil(share * self.lane_capacity(lane)))
