"""Building blocks of the Llama-family forward pass: linear, norm and rotary embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from expresslane.kernels.plan import (
    ROW_KERNEL_ROWS,
    ROW_PATHS,
    LinearPath,
    dense_path,
    linear_path,
)


class Linear(nn.Module):
    """y = x W^T + b, in the activations' dtype.

    `prepare_cpu` lays the weight out for the path the execution plan chooses for it
    (models/plan.py: `linear_path`); `forward` runs that path."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features = weight.shape[0]
        self.path = LinearPath.TORCH
        self._packed: torch.Tensor | None = None  # oneDNN's blocked layout
        self._half: torch.Tensor | None = None  # what the bf16/fp16 row or dot kernel reads
        self._half_kernel = None
        self.matrix: torch.Tensor | None = None  # plain bf16, for prompt rows in oneDNN

    def prepare_cpu(self, compute_dtype: torch.dtype, keep_matrix: bool = False) -> None:
        """`keep_matrix`: where the dot-product kernel takes the weight, keep its plain bf16
        copy too, for prompt rows in oneDNN's matmul (kernels/linear_choice.py)."""
        from expresslane.kernels import cpu_kernels

        w = self.weight.data
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.data.to(compute_dtype), requires_grad=False)
        self.path = linear_path(w, compute_dtype)
        if self.path is LinearPath.BF16_DOT:
            kernels = cpu_kernels()
            self._half, self._half_kernel = kernels.pack_bf16_dot(w), kernels.bf16_dot_linear
            self.matrix = w.contiguous() if keep_matrix else None
            self.weight = None
            return
        if self.path in ROW_PATHS:
            self._half, self._half_kernel = _row_kernel(w)
        w = w.to(compute_dtype)
        if dense_path(compute_dtype) is LinearPath.ONEDNN:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
            self.weight = None  # the packed copy replaces the plain one
        else:
            self.weight = nn.Parameter(w, requires_grad=False)

    def kernel_weights(self) -> list[torch.Tensor] | None:
        """What the C++ layer stack needs to run this layer, or None if it cannot."""
        return None if self._half_kernel is None else [self._half]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.path is LinearPath.BF16_DOT or (
            self.path in ROW_PATHS and x.shape[0] <= ROW_KERNEL_ROWS
        ):
            return self._half_kernel(x, self._half, self.bias)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(
                x, self._packed, self.bias, "none", [None], ""
            )
        return F.linear(x, self.weight, self.bias)


def _row_kernel(w: torch.Tensor):
    """(what the kernel reads, the kernel) for a 16-bit weight of a row path: float16 packed
    for the AVX-512 float16 kernel where the build has it, else the row kernel on W as stored."""
    from expresslane.kernels import cpu_kernels

    kernels = cpu_kernels()
    if w.dtype == torch.float16 and kernels.f16_dot_available() and w.shape[0] % 16 == 0:
        return kernels.pack_f16_dot(w), kernels.f16_dot_linear
    return w, kernels.half_linear


def make_linear(weight, bias: torch.Tensor | None = None) -> nn.Module:
    """A `Linear`; an `Fp4Linear` for a weight read from an FP4 checkpoint, an `Int4Linear`
    for 4-bit blocks kept from a GGUF file."""
    from expresslane.quant.int4 import Int4Weight
    from expresslane.quant.int4_linear import Int4Linear
    from expresslane.quant.linear import Fp4Linear, Fp4Weight

    if isinstance(weight, Int4Weight):
        return Int4Linear(weight, bias)
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
    which makes RoPE three tensor ops instead of six. `attention_factor` (YaRN's and LongRoPE's
    mscale, see models/rope.py) multiplies both tables, as transformers does."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        max_positions: int,
        dtype: torch.dtype,
        attention_factor: float = 1.0,
    ):
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = inv_freq.numel()
        cos = emb.cos() * attention_factor
        sin = emb.sin() * attention_factor
        sin[:, :half].neg_()
        self.register_buffer("cos", cos.to(dtype), persistent=False)
        self.register_buffer("sin_signed", sin.to(dtype), persistent=False)
        self.half = half

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for these positions, shaped [T, 1, D] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, half: int
) -> torch.Tensor:
    return torch.addcmul(x * cos, torch.roll(x, half, dims=-1), sin_signed)
