"""4-bit integer weights in blocks of 32: GGUF's Q4_0, Q4_1 and Q4_K kept as they are stored
(quant/gguf_blocks.py reads them), and the reference the kernel is tested against.

A weight [N, K] holds K/32 blocks per row: 32 codes 0..15 (two per byte, element 2i in the low
nibble, as quant/formats.py packs FP4), a scale and a min; a value is scale x code + min.
Without mins a value is scale x (code - 8) (Q4_0). Q4_0's and Q4_1's float16 scale and min
stay float16; Q4_K's super-blocks of 256 give each of their 32-blocks the scale d x sc and
the min -dmin x m (6-bit sc and m), exact in float32 but not in float16. Dequantized, every
value equals what `gguf.quants.dequantize` gives, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from expresslane.quant.formats import unpack_nibbles

BLOCK = 32


@dataclass
class Int4Weight:
    """A (possibly fused) 4-bit integer weight: codes uint8 [N, K/2], scales [N, K/32]
    (float16 or float32), mins as the scales or None (then -8 x the scale)."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 2

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        q = unpack_nibbles(self.codes).float().view(n, k // BLOCK, BLOCK)
        s = self.scales.float().unsqueeze(-1)
        values = s * (q - 8) if self.mins is None else s * q + self.mins.float().unsqueeze(-1)
        return values.view(n, k).to(dtype)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Int4Weight:
        """`fn` (a reordering of rows) applied to the codes, scales and mins alike."""
        mins = None if self.mins is None else fn(self.mins)
        return Int4Weight(fn(self.codes), fn(self.scales), mins)

    def to(self, target: torch.device | str | torch.dtype) -> Int4Weight | torch.Tensor:
        """To a device; or, given a dtype, the dequantized tensor in it (as a tensor's `.to`
        gives its values in that dtype)."""
        if isinstance(target, torch.dtype):
            return self.dequantize(target)
        return self.map_rows(lambda t: t.to(target))

    @classmethod
    def cat(cls, parts: list[Int4Weight]) -> Int4Weight:
        """The parts' rows one after another (fused q/k/v, gate/up)."""
        dtypes = {p.scales.dtype for p in parts}
        if all(p.mins is None for p in parts):
            dtype = torch.float32 if len(dtypes) > 1 else dtypes.pop()
            return cls(torch.cat([p.codes for p in parts]), _cat(parts, "scales", dtype), None)
        # a part without mins gets its -8 x scale, in float32 (float16 could overflow)
        mins = [p.mins if p.mins is not None else -8 * p.scales.float() for p in parts]
        dtype = torch.float32 if len(dtypes | {m.dtype for m in mins}) > 1 else dtypes.pop()
        codes = torch.cat([p.codes for p in parts])
        return cls(codes, _cat(parts, "scales", dtype), torch.cat([m.to(dtype) for m in mins]))

    @property
    def nbytes(self) -> int:
        mins = 0 if self.mins is None else self.mins.nbytes
        return self.codes.nbytes + self.scales.nbytes + mins

    def kernel_tensors(self) -> list[torch.Tensor]:
        """[codes, scales, mins] as kernels/int4_cpu.cpp takes them (no mins: an empty tensor)."""
        mins = self.mins if self.mins is not None else self.scales.new_empty(0)
        return [self.codes, self.scales, mins]


def _cat(parts: list[Int4Weight], field: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([getattr(p, field).to(dtype) for p in parts])
