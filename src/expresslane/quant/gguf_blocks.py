"""GGUF's 4-bit blocks (Q4_0, Q4_1, Q4_K) as `Int4Weight`s, without widening a value.

Blocks as llama.cpp stores them (`gguf.quants`): Q4_0 is 18 bytes per 32 values (float16 d,
then 16 bytes whose low nibbles are values 0-15 and high nibbles values 16-31; a value is
d x (q - 8)); Q4_1 is 20 (float16 d and m, the same 16 bytes; d x q + m); Q4_K is 144 per 256
(float16 d and dmin, 12 bytes of 6-bit scales and mins for its eight 32-blocks, then per pair
of 32-blocks 32 bytes, the first block in the low nibbles; d x sc x q - dmin x m). Codes are
rewritten into the engine's order (two consecutive values per byte).
"""

from __future__ import annotations

import numpy as np
import torch

from expresslane.quant.formats import pack_nibbles
from expresslane.quant.int4 import BLOCK, Int4Weight

# the GGML types (by name) read this way
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def int4_from_gguf(data: np.ndarray, type_name: str) -> Int4Weight:
    """A GGUF tensor's bytes ([rows, bytes per row], as `GGUFReader` gives them) of type
    `type_name` (one of INT4_TYPES)."""
    raw = torch.from_numpy(np.array(data, dtype=np.uint8))  # a copy: the file is mapped
    if type_name == "Q4_K":
        return _q4_k(raw)
    size = 18 if type_name == "Q4_0" else 20
    blocks = raw.view(raw.shape[0], -1, size)
    d = _half(blocks[..., 0:2])
    m = _half(blocks[..., 2:4]) if type_name == "Q4_1" else None
    qs = blocks[..., size - 16 :]
    return Int4Weight(_engine_order(torch.cat([qs & 0x0F, qs >> 4], dim=-1)), d, m)


def _q4_k(raw: torch.Tensor) -> Int4Weight:
    from gguf.quants import Q4_K

    rows = raw.shape[0]
    sb = raw.view(rows, -1, 144)
    d, dmin = _half(sb[..., 0:2]).float(), _half(sb[..., 2:4]).float()
    sc, m = (torch.from_numpy(a) for a in Q4_K.get_scale_min(sb[..., 4:16].reshape(-1, 12).numpy()))
    scales = (d.unsqueeze(-1) * sc.view(rows, -1, 8).float()).view(rows, -1)
    mins = -(dmin.unsqueeze(-1) * m.view(rows, -1, 8).float()).view(rows, -1)
    qs = sb[..., 16:].reshape(rows, -1, 4, 1, BLOCK)  # 4 pairs of blocks: low nibbles first
    values = torch.cat([qs & 0x0F, qs >> 4], dim=3)
    return Int4Weight(_engine_order(values), scales, mins)


def _half(two_bytes: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> [...] float16."""
    return two_bytes.contiguous().view(torch.float16).squeeze(-1)


def _engine_order(values: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 in value order, any shape with rows first -> [rows, K/2] bytes."""
    return pack_nibbles(values.reshape(values.shape[0], -1)).contiguous()
