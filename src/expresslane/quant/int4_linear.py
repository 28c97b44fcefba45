"""A linear layer over 4-bit integer blocks (GGUF's Q4_0, Q4_1, Q4_K; quant/int4.py): on CPUs
the kernel in kernels/int4_cpu.cpp (activations quantized to int8 per 32 values, as the FP4
kernel does), elsewhere the PyTorch reference, which expands the weight at each call."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from expresslane.kernels.plan import LinearPath, int4_path
from expresslane.quant.int4 import Int4Weight
from expresslane.quant.linear import BlockLinear


class Int4Linear(BlockLinear):
    """y = x W^T + b with W kept in 4-bit integer blocks of 32. Each row's result does not
    depend on the rows beside it in the kernel (kernels/plan.py: `int4_path`).

    Unlike `Fp4Linear` it keeps no bf16 copy of the weight for prompt rows in oneDNN: the
    blocks stay 4-bit in memory (5 bits per weight for Q4_1), and prompts run the kernel too
    (slower from ~64 prompt rows on, BENCHMARKS.md)."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None):
        parts = {"codes": weight.codes, "scales": weight.scales, "mins": weight.mins}
        super().__init__(parts, bias, LinearPath.INT4_DEQUANTIZE)

    @property
    def weight_int4(self) -> Int4Weight:
        return Int4Weight(self.codes, self.scales, self.mins)

    def prepare_cpu(self, compute_dtype: torch.dtype, keep_matrix: bool = False) -> None:
        """`keep_matrix` is declined (no bf16 copy: see the class docstring)."""
        from expresslane.kernels import cpu_kernels

        self._bias_to(compute_dtype)
        self.path = int4_path(compute_dtype)
        if self.path is LinearPath.INT4_W4A8:
            self._kernel = cpu_kernels().int4_linear

    def kernel_weights(self) -> list[torch.Tensor] | None:
        return None if self._kernel is None else self.weight_int4.kernel_tensors()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is None or x.is_cuda:
            return self.reference(x)
        return self._kernel(x, *self.weight_int4.kernel_tensors(), self.bias)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight_int4.dequantize(x.dtype), self.bias)
