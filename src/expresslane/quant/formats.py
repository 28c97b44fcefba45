"""Block-scaled 4-bit floating point: MXFP4 and NVFP4 (reference implementation).

Both store E2M1 values (1 sign, 2 exponent, 1 mantissa bits; the magnitudes 0, 0.5, 1, 1.5,
2, 3, 4, 6), two per byte, the first value of each pair in the low nibble, code 8-15 the
negatives of 0-7. They differ in the block scale:

- MXFP4 (OCP Microscaling v1.0): blocks of 32 values share a power of two stored as E8M0 (the
  byte is the exponent + 127). The scale is 2^(floor(log2(amax)) - 2), the OCP rule, so the
  block maximum lands in [4, 8) and values past 6 clip to 6.
- NVFP4: blocks of 16 share an FP8 E4M3 scale, and the tensor has one FP32 scale
  s = amax / (448 * 6), so block scales use E4M3's whole range. A block's scale is
  e4m3(block_amax / 6 / s).

Values are rounded to the nearest E2M1 grid point, ties to the even code (round to nearest
even, as IEEE casts and torchao do; ggml breaks ties towards the smaller magnitude instead).
This module is the reference the kernels are tested against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from expresslane.kernels.constants import ScaleKind
from expresslane.names import QUANTIZATIONS

E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Midpoints between neighbouring magnitudes; at a tie the even code (mantissa bit 0) wins:
# 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@dataclass(frozen=True)
class Fp4Format:
    name: str
    block_size: int
    scale_dtype: str  # "e8m0" or "e4m3"
    tensor_scale: bool  # a per-tensor FP32 scale on top of the block scales

    @property
    def bits_per_value(self) -> float:
        return 4 + 8 / self.block_size

    @property
    def kernel_scale_kind(self) -> ScaleKind:
        """How the kernels (C++ and Triton) read a scale byte."""
        return ScaleKind.E4M3 if self.scale_dtype == "e4m3" else ScaleKind.E8M0


MXFP4 = Fp4Format("mxfp4", 32, "e8m0", tensor_scale=False)
NVFP4 = Fp4Format("nvfp4", 16, "e4m3", tensor_scale=True)
FORMATS = {name: {f.name: f for f in (MXFP4, NVFP4)}[name] for name in QUANTIZATIONS}


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, 0-15) of the nearest E2M1 values, ties to even, clamped to +-6."""
    mag = x.abs().float()
    index = torch.zeros_like(mag, dtype=torch.uint8)
    for k, mid in enumerate(_MIDPOINTS):
        # Odd k: the upper neighbour has the even code, so a tie goes up (>=).
        index += (mag >= mid if k % 2 else mag > mid).to(torch.uint8)
    return index | (torch.signbit(x).to(torch.uint8) << 3)


@functools.cache
def _e2m1_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    # the table is built once per device: no host copy inside a captured decode step
    return _e2m1_table(codes.device)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes, element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def e8m0_decode(exponents: torch.Tensor) -> torch.Tensor:
    return torch.exp2(exponents.float() - 127)


def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float8_e4m3fn).float()


@dataclass
class Fp4Tensor:
    """A quantized weight [N, K]: codes [N, K/2] (uint8), block scales [N, K/block] (uint8:
    E8M0 exponents or E4M3 bits) and, for NVFP4, the FP32 tensor scale."""

    fmt: Fp4Format
    packed: torch.Tensor
    scales: torch.Tensor
    tensor_scale: float = 1.0

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def block_scales(self) -> torch.Tensor:
        """Float32 [N, K/block] scale of each block, tensor scale included."""
        if self.fmt.scale_dtype == "e8m0":
            return e8m0_decode(self.scales)
        return e4m3_decode(self.scales) * self.tensor_scale

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        values = e2m1_decode(unpack_nibbles(self.packed)).view(n, k // self.fmt.block_size, -1)
        return (values * self.block_scales().unsqueeze(-1)).view(n, k).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() + (4 if self.fmt.tensor_scale else 0)


def quantize(weight: torch.Tensor, fmt: Fp4Format) -> Fp4Tensor:
    """Quantize a [N, K] weight (K a multiple of the block size) to `fmt`."""
    n, k = weight.shape
    bs = fmt.block_size
    if k % bs:
        raise ValueError(f"{fmt.name}: the input dimension {k} is not a multiple of {bs}")
    w = weight.float().view(n, k // bs, bs)
    amax = w.abs().amax(dim=-1)
    if fmt.scale_dtype == "e8m0":
        exp = torch.floor(torch.log2(amax.clamp(min=2.0**-127))) - 2  # OCP: max lands in [4, 8)
        exps = (exp + 127).clamp(0, 254)
        scales_u8 = exps.to(torch.uint8)
        block = e8m0_decode(scales_u8)
        tensor_scale = 1.0
    else:
        tensor_amax = float(amax.max())
        tensor_scale = tensor_amax / (E4M3_MAX * E2M1_MAX) if tensor_amax > 0 else 1.0
        e4m3 = (amax / E2M1_MAX / tensor_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        scales_u8 = e4m3.view(torch.uint8)
        block = e4m3.float() * tensor_scale
    safe = torch.where(block > 0, block, torch.ones_like(block))
    codes = e2m1_encode((w / safe.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX))
    return Fp4Tensor(fmt, pack_nibbles(codes.view(n, k)), scales_u8, tensor_scale)
