"""Prompt-lookup proposer: find the most recent earlier occurrence of the last n tokens in
the prompt and output so far, and propose what followed it. Strong when the output copies
from the input (code edits, quoting, refactors); free to compute."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from expresslane.engine.request import Request
from expresslane.spec.proposal import Proposal


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: list[Request], lengths: list[int]) -> list[Proposal]:
        return [
            Proposal(self.lookup(r.token_ids, k)) for r, k in zip(requests, lengths, strict=True)
        ]

    def release(self, request_id: str) -> None:
        pass  # keeps no per-request state

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        (periodic: when that occurrence overlaps the suffix, the period is repeated)."""
        tokens = np.asarray(token_ids)
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            windows = sliding_window_view(tokens[: L - 1], n)  # earlier n-grams only
            hits = np.flatnonzero((windows == tokens[L - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                guess = tokens[start : start + k].tolist()
                # A match that ends near the end of the context overlaps what it predicts: the
                # sequence is periodic there, so keep copying through the guess itself.
                while 0 < len(guess) < k:
                    guess.append(guess[len(guess) - (L - start)])
                return guess
        return []
