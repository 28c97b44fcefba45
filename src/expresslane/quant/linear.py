"""A linear layer with block-scaled 4-bit weights (MXFP4 / NVFP4), as engines run FP4 on
hardware without FP4 matmuls: activations in float on CUDA and in the reference, quantized to
int8 per 32 values by the CPU kernel (W4A8) where K is a multiple of 32."""

from __future__ import annotations

import torch
from torch import nn

from expresslane.kernels import triton_fp4_linear
from expresslane.quant.formats import Fp4Format, Fp4Tensor


class Fp4Weight:
    """A (possibly fused) FP4 weight: codes [N, K/2], block scales [N, K/block] (uint8) and
    a float32 scale per output row (NVFP4's tensor scale, per fused part)."""

    def __init__(self, fmt: Fp4Format, packed, scales, row_scales):
        self.fmt = fmt
        self.packed = packed
        self.scales = scales
        self.row_scales = row_scales

    @classmethod
    def from_tensor(cls, t: Fp4Tensor) -> Fp4Weight:
        rows = torch.full((t.packed.shape[0],), t.tensor_scale, dtype=torch.float32)
        return cls(t.fmt, t.packed, t.scales, rows)

    @classmethod
    def cat(cls, parts: list[Fp4Weight]) -> Fp4Weight:
        if len({p.fmt for p in parts}) != 1:
            raise ValueError("cannot fuse weights of different formats")
        return cls(
            parts[0].fmt,
            torch.cat([p.packed for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.row_scales for p in parts]),
        )

    def to(self, device: torch.device) -> Fp4Weight:
        return Fp4Weight(
            self.fmt, self.packed.to(device), self.scales.to(device), self.row_scales.to(device)
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = Fp4Tensor(self.fmt, self.packed, self.scales)  # tensor scale 1: rows carry it
        return (t.dequantize() * self.row_scales.unsqueeze(1)).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() + 4 * self.row_scales.numel()


class Fp4Linear(nn.Module):
    """y = x W^T + b with W stored as FP4.

    On CPUs with AVX2 every batch runs the kernel in kernels/fp4_cpu.cpp, which expands codes
    in registers (activations quantized to int8 per 32 values where K is a multiple of 32).
    Each row's result does not depend on the rows beside it (`row_invariant`), and the kernel
    is as fast as expanding the whole weight for a float32 GEMM even at 512 rows (SmolLM2's
    gate/up at 512 rows: 6.9 against 8.3 ms; 8 rows: 0.11 against 0.43 ms). On CUDA the
    Triton kernel in kernels/fp4_triton.py expands codes tile by tile inside the matmul.
    Without the kernels (other CPUs, no Triton) every call expands with PyTorch ops:
    `reference`, which the kernels are tested against."""

    # Decode-only steps of up to this many tokens run the native decode step (LlamaModel)
    # where not every step does (an output head without a row-invariant kernel): a batch-64
    # decode step of SmolLM2-135M took 264 ms there against 506 ms in the Python layers.
    DECODE_ROWS = 64

    def __init__(self, weight: Fp4Weight, bias: torch.Tensor | None = None):
        super().__init__()
        self.fmt = weight.fmt
        self.register_buffer("packed", weight.packed, persistent=False)
        self.register_buffer("scales", weight.scales, persistent=False)
        self.register_buffer("row_scales", weight.row_scales, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features = weight.packed.shape[0]
        self._kernel = None
        self.row_invariant = False  # the CPU kernel runs every batch

    @property
    def weight_fp4(self) -> Fp4Weight:
        return Fp4Weight(self.fmt, self.packed, self.scales, self.row_scales)

    def prepare_cpu(self, compute_dtype: torch.dtype) -> None:
        from expresslane.kernels import cpu_kernels

        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.data.to(compute_dtype), requires_grad=False)
        kernels = cpu_kernels()
        if kernels is not None and compute_dtype == torch.float32:
            self._kernel = kernels.fp4_linear
            self.row_invariant = True

    def kernel_weights(self) -> list[torch.Tensor] | None:
        return None if self._kernel is None else [self.packed, self.scales, self.row_scales]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = triton_fp4_linear() if x.is_cuda else self._kernel
        if kernel is None:
            return self.reference(x)
        fmt = self.fmt
        return kernel(
            x,
            self.packed,
            self.scales,
            self.row_scales,
            self.bias,
            fmt.block_size,
            fmt.kernel_scale_kind,
        )

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight_fp4.dequantize(x.dtype)
        return torch.nn.functional.linear(x, w, self.bias)
