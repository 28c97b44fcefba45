"""What the server may read of a running engine: a copy taken at one moment, so that the HTTP
thread never walks the scheduler's lists while the step loop changes them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpecCounts:
    steps: int = 0  # verification passes that checked guesses
    proposed: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class EngineSnapshot:
    running: dict[str, int] = field(default_factory=dict)  # lane -> requests in the batch
    waiting: dict[str, int] = field(default_factory=dict)  # lane -> requests queued
    targets: dict[str, float] = field(default_factory=dict)  # lane -> tokens/s it is held at
    spec: dict[str, SpecCounts] = field(default_factory=dict)  # lane -> speculation counters
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    # a fleet's ingress: requests it routed per (pool, replica, tier) since it started
    routed: dict[tuple[str, str, str], int] = field(default_factory=dict)
