"""Does speculation pay at this batch size? Measured rather than predicted: for decode steps
with guesses and without, a running average of wall time per emitted token, per batch-size
bucket (1, 2, 3-4, 5-8, ...). Guessing can lose even when guesses are often right: a draft
model's proposals take time, and next to a cheap target the extra verification rows cost about
as much as the tokens they save. Where steps with guesses are slower per token, speculation
turns off. Some steps still run the other way, so that a change (a warmer machine, a request
that starts copying its prompt) is noticed: every `explore_every`-th while a bucket is untimed,
then every `settled_explore_every`-th while guessing pays and every `recheck_every`-th while it
does not. Rechecks are the more frequent: a verdict against guessing can rest on cold steps
at a request's start (its acceptance rate still unknown, its guesses short) and would
otherwise stop it for a long while, and a recheck costs at most one slower step in 16 (an
exploring draft model first catches up, natively, on the tokens it skipped)."""

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
        recheck_every: int = 16,
        min_samples: int = 12,
        weight: float = 0.03,
    ):
        self.explore_every = explore_every
        self.settled_explore_every = settled_explore_every
        self.recheck_every = recheck_every
        self.min_samples = min_samples
        self.weight = weight
        self.buckets: dict[int, _Bucket] = {}

    def _bucket(self, batch: int) -> _Bucket:
        return self.buckets.setdefault((max(batch, 1) - 1).bit_length(), _Bucket())

    def pays(self, batch: int) -> bool | None:
        """True / False once both ways have been timed at this batch size; None before."""
        arms = self._bucket(batch).arms
        spec, plain = arms[True], arms[False]
        if min(spec.samples, plain.samples) < self.min_samples:
            return None
        return spec.seconds_per_token <= plain.seconds_per_token

    def speculate(self, batch: int) -> bool:
        """Whether this step at this running batch size should guess (one call per step)."""
        bucket = self._bucket(batch)
        bucket.decisions += 1
        better = self.pays(batch)
        if better is None:
            every = self.explore_every
        else:
            every = self.settled_explore_every if better else self.recheck_every
        explore = bucket.decisions % every == 0
        if better is None:  # guess, and time a plain step now and then to compare
            return not explore
        return better != explore

    def record(self, batch: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A decode-only step: its wall time (proposals included) and the tokens it emitted."""
        if tokens > 0:
            self._bucket(batch).arms[speculated].add(seconds / tokens, self.weight)
