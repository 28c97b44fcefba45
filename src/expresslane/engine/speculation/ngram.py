"""Prompt-lookup proposer: find the most recent earlier occurrence of the last n tokens in
the prompt and output so far, and propose what followed it. Strong when the output copies
from the input (code edits, quoting, refactors); nearly free to compute: each request keeps
an index of its n-grams that grows with its tokens, so a lookup is a few dictionary probes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from expresslane.engine.speculation.proposal import Proposal

if TYPE_CHECKING:
    from expresslane.engine.request import Request


class NgramIndex:
    """For each n, the latest start of every n-gram that ends before a sequence's last token.
    Sequences only grow (guesses live outside them), so new tokens are indexed as they come."""

    def __init__(self, min_n: int, max_n: int):
        self.sizes = range(min_n, max_n + 1)
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0  # the sequence length when last updated

    def update(self, tokens: list[int]) -> None:
        if len(tokens) < self.indexed:  # not the sequence this index was built on
            self.latest = {n: {} for n in self.sizes}
            self.indexed = 0
        L = len(tokens)
        for n in self.sizes:
            table = self.latest[n]
            for i in range(max(0, self.indexed - n), L - n):  # n-grams ending before L - 1
                table[tuple(tokens[i : i + n])] = i
        self.indexed = L


class NgramProposer:
    free = True  # a lookup costs next to nothing: the engine asks for the most guesses

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n = min_n
        self.max_n = max_n
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, requests: list[Request], lengths: list[int]) -> list[Proposal]:
        proposals = []
        for r, k in zip(requests, lengths, strict=True):
            index = self.indexes.get(r.request_id)
            if index is None:
                index = self.indexes[r.request_id] = NgramIndex(self.min_n, self.max_n)
            guess, n = self.lookup(r.token_ids, k, index)
            proposals.append(Proposal(guess, kind=n))
        return proposals

    def release(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)

    def lookup(
        self, token_ids: list[int], k: int, index: NgramIndex | None = None
    ) -> tuple[list[int], int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        (periodic: when that occurrence overlaps the suffix, the period is repeated), and the
        length of that suffix (0: no match, no guess)."""
        if index is None:
            index = NgramIndex(self.min_n, self.max_n)
        index.update(token_ids)
        L = len(token_ids)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            hit = index.latest[n].get(tuple(token_ids[L - n :]))
            if hit is not None:
                start = hit + n
                guess = token_ids[start : start + k]
                # A match that ends near the end of the context overlaps what it predicts: the
                # sequence is periodic there, so keep copying through the guess itself.
                while 0 < len(guess) < k:
                    guess.append(guess[len(guess) - (L - start)])
                return guess, n
        return [], 0
