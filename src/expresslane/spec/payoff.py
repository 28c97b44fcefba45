"""Does speculation pay at this batch size? Measured, not predicted: a running average of the
wall time per emitted token of decode steps with guesses and of steps without, per batch size
(powers of two). Where guessing is slower, which the proposer's cost alone can make it (a draft
model next to a target that is itself cheap, or guesses that are seldom right), speculation
turns off, and some steps of each batch size run the other way, so that a change (a warmer
machine, a request that starts copying its prompt) is noticed: every
`explore_every`-th step until both ways are timed, every `settled_explore_every`-th after
(an exploring draft model first catches up on the tokens it skipped, which costs)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Arm:
    seconds_per_token: float = 0.0
    samples: int = 0

    def add(self, value: float, weight: float) -> None:
        self.samples += 1
        w = max(weight, 1.0 / self.samples)  # a plain mean until the window fills
        self.seconds_per_token += w * (value - self.seconds_per_token)


@dataclass
class _Bucket:
    arms: dict[bool, _Arm] = field(default_factory=lambda: {True: _Arm(), False: _Arm()})
    decisions: int = 0


class SpecPayoff:
    def __init__(
        self,
        explore_every: int = 8,
        settled_explore_every: int = 64,
        min_samples: int = 4,
        weight: float = 0.1,
    ):
        self.explore_every = explore_every
        self.settled_explore_every = settled_explore_every
        self.min_samples = min_samples
        self.weight = weight
        self.buckets: dict[int, _Bucket] = {}

    def _bucket(self, batch: int) -> _Bucket:
        return self.buckets.setdefault((max(batch, 1) - 1).bit_length(), _Bucket())

    def pays(self, batch: int) -> bool | None:
        """True / False once both ways have been timed at this batch size; None before."""
        spec, plain = self._bucket(batch).arms[True], self._bucket(batch).arms[False]
        if min(spec.samples, plain.samples) < self.min_samples:
            return None
        return spec.seconds_per_token <= plain.seconds_per_token

    def speculate(self, batch: int) -> bool:
        """Whether this step at this running batch size should guess (one call per step)."""
        bucket = self._bucket(batch)
        bucket.decisions += 1
        better = self.pays(batch)
        every = self.explore_every if better is None else self.settled_explore_every
        explore = bucket.decisions % every == 0
        if better is None:  # guess, and time a plain step now and then to compare
            return not explore
        return better != explore

    def record(self, batch: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A decode-only step: its wall time (proposals included) and the tokens it emitted."""
        if tokens > 0:
            self._bucket(batch).arms[speculated].add(seconds / tokens, self.weight)
