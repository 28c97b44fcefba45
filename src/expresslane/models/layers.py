"""Building blocks of the Llama-family forward pass: linear, norm and rotary embedding."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def onednn_prepack_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack a linear weight of this dtype on this CPU."""
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype), 1)
        x = torch.ones(1, 8, dtype=dtype)
        y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")
        return bool(torch.allclose(y.float(), torch.full((1, 8), 8.0)))
    except (RuntimeError, AttributeError):
        return False


class Linear(nn.Module):
    """y = x W^T + b. On CPU the weight can be prepacked once into oneDNN's blocked layout,
    which reads it about 1.3-1.5x faster per matmul at small batch than `F.linear`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features = weight.shape[0]
        self._packed: torch.Tensor | None = None

    def prepack(self) -> None:
        w = self.weight
        if w.device.type == "cpu" and onednn_prepack_supported(w.dtype):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.data, 1)
            self.weight = None  # the packed copy replaces the plain one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(
                x, self._packed, self.bias, "none", [None], ""
            )
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Rotary(nn.Module):
    """Precomputed cos/sin tables in Hugging Face's half-split layout.

    `rotate_half(x) * sin` equals `roll(x, D/2) * sin_signed` with sin_signed = [-sin, sin],
    which makes RoPE three tensor ops instead of six."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype):
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = inv_freq.numel()
        sin = emb.sin()
        sin[:, :half].neg_()
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin_signed", sin.to(dtype), persistent=False)
        self.half = half

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for these positions, shaped [T, 1, D] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, half: int
) -> torch.Tensor:
    return torch.addcmul(x * cos, torch.roll(x, half, dims=-1), sin_signed)
