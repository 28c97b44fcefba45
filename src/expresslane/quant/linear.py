"""A linear layer with block-scaled 4-bit weights (MXFP4 / NVFP4), as engines run FP4 on
hardware without FP4 matmuls: activations in float on CUDA and in the reference, quantized to
int8 per 32 values by the CPU kernel (W4A8) where K is a multiple of 32."""

from __future__ import annotations

import torch
from torch import nn

from expresslane.kernels import triton_fp4_linear
from expresslane.kernels.plan import LinearPath, fp4_path
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


class BlockLinear(nn.Module):
    """A linear layer over a weight held in parts (codes, block scales, ...) kept as buffers,
    run by a kernel chosen in `prepare_cpu` (`_kernel`) or by its PyTorch reference."""

    def __init__(self, parts: dict[str, torch.Tensor | None], bias, path: LinearPath):
        super().__init__()
        for name, t in parts.items():
            self.register_buffer(name, t, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features = next(iter(parts.values())).shape[0]
        self.path = path
        self._kernel = None
        self.matrix: torch.Tensor | None = None  # dequantized bf16, for prompt rows in oneDNN

    def _bias_to(self, compute_dtype: torch.dtype) -> None:
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.data.to(compute_dtype), requires_grad=False)


class Fp4Linear(BlockLinear):
    """y = x W^T + b with W stored as FP4.

    On CPUs with AVX2 every batch runs the kernel in kernels/fp4_cpu.cpp, which expands codes
    in registers (activations quantized to int8 per 32 values where K is a multiple of 32);
    each row's result does not depend on the rows beside it (models/plan.py: `fp4_path`). On
    CUDA the Triton kernel in kernels/fp4_triton.py expands codes tile by tile inside the
    matmul. Without the kernels every call expands with PyTorch ops: `reference`, which the
    kernels are tested against."""

    def __init__(self, weight: Fp4Weight, bias: torch.Tensor | None = None):
        parts = {"packed": weight.packed, "scales": weight.scales, "row_scales": weight.row_scales}
        super().__init__(parts, bias, LinearPath.FP4_DEQUANTIZE)
        self.fmt = weight.fmt

    @property
    def weight_fp4(self) -> Fp4Weight:
        return Fp4Weight(self.fmt, self.packed, self.scales, self.row_scales)

    def prepare_cpu(self, compute_dtype: torch.dtype, keep_matrix: bool = False) -> None:
        """`keep_matrix`: where the FP4 kernel runs, also keep the weight dequantized to bf16,
        for prompt rows in oneDNN's matmul (kernels/linear_choice.py)."""
        from expresslane.kernels import cpu_kernels

        self._bias_to(compute_dtype)
        self.path = fp4_path(compute_dtype)
        if self.path is LinearPath.FP4_W4A8:
            self._kernel = cpu_kernels().fp4_linear
            if keep_matrix:
                self.matrix = self.weight_fp4.dequantize(torch.bfloat16).contiguous()

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
