"""Acceptance counters for speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecStats:
    steps: int = 0  # verification passes with at least one guess
    proposed: int = 0
    accepted: int = 0

    def record(self, proposed: int, accepted: int) -> None:
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens produced per verification pass (accepted guesses + the model's own)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0
