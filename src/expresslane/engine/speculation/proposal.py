"""What a proposer returns for one request."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Proposal:
    token_ids: list[int] = field(default_factory=list)
    # [len(token_ids), vocab]: the distribution q each guess was drawn from, which rejection
    # sampling needs for sampled requests. None: the guesses are deterministic (q is one-hot).
    probs: torch.Tensor | None = None
    # proposals of one kind share an acceptance estimate (acceptance.py); n-gram lookup:
    # the length of the matched n-gram
    kind: int = 0
