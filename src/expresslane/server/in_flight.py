"""`InFlight`: the generations a server admitted and that have not ended, counted per lane, per
key, and per key within each lane: what the queue bounds and a key's lane share are checked
against (`accounts.py`). A generation counts from admission (before its prompt is tokenized)
until its ledger row is written, so concurrent requests see each other's reservations."""

from __future__ import annotations

from collections import Counter


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
