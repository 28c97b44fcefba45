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
    """y = x W^T + b, in the activations' dtype.

    `prepare_cpu` picks the CPU layout once at load time. A bf16 checkpoint computed in
    float32 on a CPU with AVX-512 BF16 runs every batch in the dot-product kernel
    (kernels/bf16dot_cpu.cpp), which rounds the activations to bf16 as oneDNN's bf16 matmul
    does, is faster than it at every batch size measured (0.2-0.97x its time from 1 to 512
    rows, benchmarks/native_steps.py), and gives each row the same result whatever the batch
    (`row_invariant`).
    Without AVX-512 BF16 the native row kernel takes decode batch sizes (it moves half the
    bytes of a float32 matmul); otherwise, and for larger batches, weights are prepacked into
    oneDNN's blocked layout (about 1.3-1.5x faster per matmul at small batch than `F.linear`).
    """

    # Up to this many rows the native decode step beats the Python layers on oneDNN where the
    # linears run the row kernel: AVX2, 63 against 92 ms for SmolLM2-135M's 120 layer linears
    # at 16 rows (float32 matmul).
    SMALL_BATCH = 16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features = weight.shape[0]
        self._packed: torch.Tensor | None = None
        self._bf16: torch.Tensor | None = None
        self._bf16_kernel = None
        self.row_invariant = False  # the bf16 dot-product kernel runs every batch

    def prepare_cpu(self, compute_dtype: torch.dtype) -> None:
        from expresslane.kernels import cpu_kernels

        w = self.weight.data
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.data.to(compute_dtype), requires_grad=False)
        if w.dtype == torch.bfloat16 and compute_dtype == torch.float32:
            kernels = cpu_kernels()
            if kernels is not None and kernels.bf16_dot_available() and _dot_packable(w):
                self._bf16, self._bf16_kernel = kernels.pack_bf16_dot(w), kernels.bf16_dot_linear
                self.row_invariant = True
                self.weight = None
                return
            if kernels is not None:  # the row kernel takes any shape
                self._bf16, self._bf16_kernel = w, kernels.bf16_linear
        w = w.to(compute_dtype)
        if onednn_prepack_supported(compute_dtype):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
            self.weight = None  # the packed copy replaces the plain one
        else:
            self.weight = nn.Parameter(w, requires_grad=False)

    def kernel_weights(self) -> list[torch.Tensor] | None:
        """What the C++ decode step needs to run this layer, or None if it cannot."""
        return None if self._bf16_kernel is None else [self._bf16]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._bf16_kernel is not None and (self.row_invariant or x.shape[0] <= self.SMALL_BATCH):
            return self._bf16_kernel(x, self._bf16, self.bias)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(
                x, self._packed, self.bias, "none", [None], ""
            )
        return F.linear(x, self.weight, self.bias)


def _dot_packable(w: torch.Tensor) -> bool:
    """Whether the bf16 dot-product kernel takes this weight: 16-column blocks, k pairs."""
    return w.shape[0] % 16 == 0 and w.shape[1] % 2 == 0


def make_linear(weight, bias: torch.Tensor | None = None) -> nn.Module:
    """A `Linear`, or an `Fp4Linear` for a weight read from an FP4 checkpoint."""
    from expresslane.quant.linear import Fp4Linear, Fp4Weight

    return Fp4Linear(weight, bias) if isinstance(weight, Fp4Weight) else Linear(weight, bias)


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
