"""Speculative decoding: proposers guess the next tokens cheaply; the target model scores all
guesses in one forward pass and keeps the longest prefix it agrees with (plus one token of its
own), so the output is exactly what plain decoding would produce."""

from __future__ import annotations

from typing import Protocol

from expresslane.spec.ngram import NgramProposer


class Proposer(Protocol):
    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k guesses for the tokens that follow `token_ids`."""


def make_proposer(spec: dict) -> tuple[Proposer, int]:
    """From `LLM(speculative=...)`: returns (proposer, tokens per step)."""
    from expresslane.errors import InvalidRequestError

    method = spec.get("method", "ngram")
    k = int(spec.get("num_tokens", 4))
    if k < 1:
        raise InvalidRequestError("speculative num_tokens must be at least 1")
    if method == "ngram":
        return NgramProposer(spec.get("min_n", 1), spec.get("max_n", 4)), k
    raise InvalidRequestError(f"unknown speculative method {method!r}; available: ngram")


__all__ = ["NgramProposer", "Proposer", "make_proposer"]
