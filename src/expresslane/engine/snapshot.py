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

    @staticmethod
    def merge(parts: list[EngineSnapshot]) -> EngineSnapshot:
        """The sum of several engines' snapshots (a fleet's replicas); targets: the lowest."""

        def add(dicts):
            out: dict = {}
            for d in dicts:
                for k, v in d.items():
                    out[k] = out.get(k, 0) + v
            return out

        spec: dict[str, SpecCounts] = {}
        for p in parts:
            for lane, c in p.spec.items():
                s = spec.get(lane, SpecCounts())
                spec[lane] = SpecCounts(
                    s.steps + c.steps, s.proposed + c.proposed, s.accepted + c.accepted
                )
        targets: dict[str, float] = {}
        for p in parts:
            for lane, t in p.targets.items():
                targets[lane] = min(t, targets.get(lane, t))
        return EngineSnapshot(
            add(p.running for p in parts),
            add(p.waiting for p in parts),
            targets,
            spec,
            sum(p.kv_used_blocks for p in parts),
            sum(p.kv_total_blocks for p in parts),
        )
