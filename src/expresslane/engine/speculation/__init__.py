"""Speculative decoding: proposers guess the next tokens cheaply; the target model scores all
guesses in one forward pass and keeps the longest prefix it agrees with (plus one token of its
own), so greedy output is exactly what plain decoding would produce; sampled requests verify
by rejection sampling (engine/sampler.py), so their distribution is unchanged."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from expresslane.engine.speculation.acceptance import LaneAcceptance
from expresslane.engine.speculation.ngram import NgramProposer
from expresslane.engine.speculation.proposal import Proposal
from expresslane.engine.speculation.suffix import SuffixProposer

if TYPE_CHECKING:
    from expresslane.engine.request import Request

# Running batch above which speculation stops paying (verification makes every sequence k+1
# tokens wide). CPU: measured with n-gram lookup on the demo model (benchmarks/spec.py,
# `--mid-batches`: max_batch None against plain), edit and complete workloads, four runs:
# 0.91-1.19x at batch 2, 0.97-1.62x at batch 4, 0.72-1.11x at batch 8. CUDA: the
# memory-bound region (not measured here yet). The ultrafast lane speculates at any batch.
DEFAULT_MAX_BATCH = {"cpu": 4, "cuda": 32}


class Proposer(Protocol):
    # True: proposing costs next to nothing (a lookup), so the engine asks for the most
    # guesses and keeps as many as the proposal's kind is expected to be worth. False: each
    # guess costs the proposer work, so the engine chooses the length before asking.
    free: bool

    def propose(self, requests: list[Request], lengths: list[int]) -> list[Proposal]:
        """Up to lengths[i] guesses for the tokens that follow requests[i]'s tokens."""

    def release(self, request_id: str) -> None:
        """Forget a finished request's state."""


@dataclass
class SpecConfig:
    proposer: Proposer
    num_tokens: int  # the most guesses per step
    max_batch: int | None  # speculate only while the running batch is at most this
    # each request's guesses follow its acceptance rate, and a lane without a speed target
    # stops guessing at batch sizes where it is measured not to pay (payoff.py)
    adaptive: bool = True
    acceptance: LaneAcceptance = field(default_factory=LaneAcceptance)


def make_proposer(
    spec: dict,
    device_type: str = "cpu",
    load_draft: Callable[[str | None], Proposer] | None = None,
) -> SpecConfig:
    """From `LLM(speculative=...)` or a lane's `speculative` setting. `load_draft(model)`
    builds a draft-model proposer (model None: the bundled draft)."""
    from expresslane.errors import InvalidRequestError

    known = {"method", "model", "num_tokens", "min_n", "max_n", "max_batch", "adaptive"}
    known |= {"cache_tokens", "min_prob", "share_across_keys"}  # suffix's
    unknown = sorted(set(spec) - known)
    if unknown:
        raise InvalidRequestError(
            f"unknown speculative setting(s) {unknown}; known: {sorted(known)}"
        )
    method = spec.get("method", "ngram")
    k = int(spec.get("num_tokens", 12))
    if k < 1:
        raise InvalidRequestError("speculative num_tokens must be at least 1")
    max_batch = spec.get("max_batch", "auto")
    if max_batch == "auto":
        max_batch = DEFAULT_MAX_BATCH.get(device_type, 8)
    adaptive = bool(spec.get("adaptive", True))
    if method == "ngram":
        proposer = NgramProposer(spec.get("min_n", 1), spec.get("max_n", 4))
        return SpecConfig(proposer, k, max_batch, adaptive)
    if method == "suffix":
        return SpecConfig(SuffixProposer.from_settings(spec), k, max_batch, adaptive)
    if method == "draft" and load_draft is not None:
        return SpecConfig(load_draft(spec.get("model")), k, max_batch, adaptive)
    raise InvalidRequestError(
        f"unknown speculative method {method!r}; available: ngram, suffix, draft"
    )


def expected_tokens(acceptance: float, guesses: int) -> float:
    """Tokens a verification yields when each guess is kept with probability `acceptance`
    until the first miss, plus the target's own: 1 + a + a^2 + ... + a^guesses."""
    if acceptance >= 1.0:
        return guesses + 1.0
    return (1.0 - acceptance ** (guesses + 1)) / (1.0 - acceptance)


def best_length(
    acceptance: float, max_tokens: int, step_seconds: Callable[[int], float], others: float = 0.0
) -> int:
    """The number of guesses (1..max_tokens) that yields the most tokens per second for the
    whole step: `step_seconds(k)` predicts the step's time with k more tokens (from the
    step-latency model, which also times the proposals), `others` the tokens the rest of the
    batch is expected to yield. Where a step costs about the same for 1 or 8 tokens (small
    models, small batches) this is the most guesses; where tokens cost, fewer (the fewest of
    equals). Runs once per request and step, so the sum is kept as k grows."""
    best, best_rate = 1, -1.0
    tokens, power = others + 1.0, 1.0
    for k in range(1, max_tokens + 1):
        power *= acceptance
        tokens += power
        rate = tokens / max(step_seconds(k), 1e-9)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def proposal_length(acceptance: float, max_tokens: int) -> int:
    """Guesses before step costs are known: about the expected run of accepted ones, a/(1-a)
    (1 at a=0.5, 4 at a=0.8), at least 1 so the rate keeps being measured."""
    if acceptance >= 0.95:
        return max_tokens
    return max(1, min(max_tokens, round(acceptance / (1 - acceptance))))


__all__ = [
    "NgramProposer",
    "Proposal",
    "Proposer",
    "SpecConfig",
    "SuffixProposer",
    "best_length",
    "expected_tokens",
    "make_proposer",
    "proposal_length",
]
