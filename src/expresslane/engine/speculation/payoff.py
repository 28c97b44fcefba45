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
exploring draft model first catches up, natively, on the tokens it skipped).

Both averages fade with the steps taken, not with their own samples: a sample that comes
after a gap of g decisions weighs 1 - (1 - weight)^g. So an arm timed only by rechecks follows
the machine as quickly as the arm that runs: otherwise its average would still hold the cold
steps of a process's first requests hundreds of steps later, and keep its verdict."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from expresslane.engine.request import Request


@dataclass
class _Arm:
    """Faded sums of step seconds and of tokens emitted: their ratio is the time per token
    (a mean of per-step ratios would weigh a step that emits one token like one that emits
    nine, and undervalue guessing)."""

    seconds: float = 0.0
    tokens: float = 0.0
    samples: int = 0
    at: int = 0  # the bucket's decision count at the last sample

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / self.tokens if self.tokens else 0.0

    def add(self, seconds: float, tokens: int, weight: float, now: int) -> None:
        self.samples += 1
        gap = max(now - self.at, 1)
        self.at = now
        faded = 1.0 - (1.0 - weight) ** gap
        w = max(faded, 1.0 / self.samples)  # a plain mean until the window fills
        self.seconds += w * (seconds - self.seconds)
        self.tokens += w * (tokens - self.tokens)


@dataclass
class StepGuesses:
    """A scheduled step's guesses, counted before it runs (accepting them empties them)."""

    count: int  # over the batch, pads included
    # a request's first guesses include a draft model's prefill of its prompt: a one-time cost
    # (like the target's prefill), not what a step with guesses costs
    first: bool

    @classmethod
    def of(cls, reqs: Iterable[Request]) -> StepGuesses:
        reqs = list(reqs)
        return cls(
            sum(len(r.spec.guesses) for r in reqs),
            any(r.spec.guesses and not r.spec.verifications for r in reqs),
        )


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
            bucket = self._bucket(batch)
            bucket.arms[speculated].add(seconds, tokens, self.weight, bucket.decisions)

    def record_step(
        self, guesses: StepGuesses, seqs: int, num_tokens: int, seconds: float, tokens: int
    ) -> None:
        """A step of `seqs` sequences and `num_tokens` tokens: timed when it only decoded
        (each sequence its last token and its guesses) and held no request's first guesses."""
        if num_tokens == seqs + guesses.count and not guesses.first:
            self.record(seqs, guesses.count > 0, seconds, tokens)
