"""FP4 (MXFP4 / NVFP4) linear layer for CUDA in Triton: y = x W^T (+ b), W stored as FP4.

Each program computes a [BLOCK_M, BLOCK_N] tile of y. Per K step it loads the packed codes
[BLOCK_N, BLOCK_K/2] and block scales [BLOCK_N, BLOCK_K/block] of its rows, expands them to
values in registers (E2M1 and E8M0/E4M3 decoded arithmetically: no table, no global
memory), multiplies the tile with ``tl.dot`` in fp32 and applies the per-row scale at the end.
The bf16 weight is never written out. Layout and rounding follow `expresslane.quant.formats`,
which is the reference this kernel is tested against (on CPU through Triton's interpreter,
``TRITON_INTERPRET=1``; see tests/test_fp4_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from expresslane.kernels.constants import ScaleKind

_E8M0 = tl.constexpr(int(ScaleKind.E8M0))  # jit functions read globals only as constexprs


@triton.jit
def e2m1_value(codes):
    magnitude = codes & 7
    exponent = magnitude >> 1
    half = (magnitude & 1).to(tl.float32) * 0.5
    power = tl.where(exponent == 3, 4.0, tl.where(exponent == 2, 2.0, 1.0))
    value = tl.where(exponent == 0, half, (1.0 + half) * power)
    return tl.where((codes & 8) != 0, -value, value)


@triton.jit
def block_scale(bits, SCALE_KIND: tl.constexpr):
    bits = bits.to(tl.int32)
    if SCALE_KIND == _E8M0:  # 2^(bits - 127)
        return tl.exp2(bits.to(tl.float32) - 127.0)
    exponent = (bits >> 3) & 15  # ScaleKind.E4M3 (fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits
    mantissa = (bits & 7).to(tl.float32) * 0.125
    normal = (1.0 + mantissa) * tl.exp2(exponent.to(tl.float32) - 7.0)
    value = tl.where(exponent == 0, mantissa * 0.015625, normal)
    return tl.where((bits & 128) != 0, -value, value)


@triton.jit
def weight_tile(
    packed_ptr,
    scales_ptr,
    cols,
    col_ok,
    k0,
    K,
    BLOCK: tl.constexpr,
    SCALE_KIND: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The weight rows `cols`, columns k0..k0+BLOCK_K, decoded to float32 values."""
    half_k = K // 2
    n_blocks = K // BLOCK
    byte_cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    codes = tl.load(
        packed_ptr + cols[:, None] * half_k + byte_cols[None, :],
        mask=col_ok[:, None] & (byte_cols[None, :] < half_k),
        other=0,
    )
    # element 2i sits in the low nibble of byte i, element 2i+1 in the high nibble
    values = tl.interleave(e2m1_value(codes & 15), e2m1_value(codes >> 4))
    scale_cols = k0 // BLOCK + tl.arange(0, BLOCK_K // BLOCK)
    scale_bits = tl.load(
        scales_ptr + cols[:, None] * n_blocks + scale_cols[None, :],
        mask=col_ok[:, None] & (scale_cols[None, :] < n_blocks),
        other=0,
    )
    scales = block_scale(scale_bits, SCALE_KIND)
    w = tl.reshape(values, (BLOCK_N, BLOCK_K // BLOCK, BLOCK)) * scales[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def fp4_linear_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    row_scales_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALE_KIND: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = weight_tile(
            packed_ptr, scales_ptr, cols, col_ok, k0, K, BLOCK, SCALE_KIND, BLOCK_N, BLOCK_K
        )
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=row_ok[:, None] & (ks[None, :] < K),
            other=0.0,
        )
        if x.dtype == tl.float32:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:  # E2M1 x E4M3 has at most 6 significant bits: exact in bf16 and fp16
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    acc *= tl.load(row_scales_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def fp4_linear_triton(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    row_scales: torch.Tensor,
    bias: torch.Tensor | None,
    block_size: int,
    scale_kind: ScaleKind,
) -> torch.Tensor:
    """x [..., K] (fp32/bf16/fp16) times the FP4 weight's transpose -> [..., N] in x.dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = x2.shape
    n = packed.shape[0]
    if packed.shape[1] * 2 != k or scales.shape[1] * block_size != k:
        raise ValueError(f"FP4 weight of {packed.shape[1] * 2} inputs, activations of {k}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    block_n, block_k = 64, 128  # BLOCK_K: a multiple of both block sizes (16, 32)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    fp4_linear_kernel[grid](
        x2,
        packed,
        scales,
        row_scales,
        bias if bias is not None else row_scales,
        out,
        m,
        n,
        k,
        x2.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK=block_size,
        SCALE_KIND=int(scale_kind),  # a ScaleKind
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out.view(*lead, n)
