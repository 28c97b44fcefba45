"""Muon: momentum SGD whose update for each weight matrix is orthogonalized (Newton-Schulz).

Used by ``train_demo_model.py`` for the transformer's hidden matrices (attention and MLP
projections); the embedding (tied to the LM head) and the norm gains stay on AdamW. Muon takes
the momentum-averaged gradient G and steps along the nearest semi-orthogonal matrix U V^T
(G = U S V^T), so every direction of the matrix moves at the same rate; at small scale this
reaches a given loss in noticeably fewer steps than AdamW. Five iterations of a quintic
Newton-Schulz map approximate U V^T cheaply (a few small matmuls per matrix and step).
"""

from __future__ import annotations

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic with a steep slope at 0 (Keller Jordan)


def orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximate U V^T for g = U S V^T; singular values land near 1 (roughly 0.7-1.2)."""
    a, b, c = NS_COEFFICIENTS
    x = g / (g.norm() + 1e-7)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """Nesterov momentum, then the orthogonalized update scaled by sqrt(max(1, rows/cols))."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if "momentum" not in self.state[p]:
                    self.state[p]["momentum"] = torch.zeros_like(p)
                buf = self.state[p]["momentum"]
                buf.mul_(beta).add_(p.grad)
                update = orthogonalize(p.grad.add(buf, alpha=beta))
                p.add_(update, alpha=-group["lr"] * max(1.0, p.size(0) / p.size(1)) ** 0.5)
