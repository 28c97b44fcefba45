"""How one layer's paged KV cache is stored: plainly, or compressed.

Slots are the same in every format (slot = block id * block_size + offset), so paging, prefix
caching and speculative rollback do not care. A store writes the new tokens' K/V at their
slots and reads any slots back as [2, num_kv_heads, n, head_dim] in the compute dtype:

- `PlainKV`: the compute dtype (`kv_cache_dtype="float32"` under float32 compute; what
  `"auto"` takes unless the next line applies).
- `Bf16KV` (`"bfloat16"`, and `"auto"` for a bf16 model computed in float32, as on a CPU:
  the model's dtype, vLLM's meaning of "auto"): bf16 rows under a float32 compute
  dtype: half the memory per token and half the bytes a decode reads (the C++ attention widens
  rows in registers as it reads them; at a 4k context a decode step is 1.39x as fast as over
  float32 rows, BENCHMARKS.md).
- `Fp8KV` (`"fp8"`): FP8 E4M3 values with one float16 scale per token and head
  (amax / 448): D + 2 bytes per head vector instead of 2D in bf16 (48% less at D = 64).
- `Fp4KV` (`"fp4"`): E2M1 codes, two per byte, with an E4M3 scale per 16 values (amax / 6),
  NVFP4's block layout without the tensor scale: D/2 + D/16 bytes (72% less than bf16).

Compressed stores dequantize what they read. Their `write` is the reference quantization
(scales and rounding): the C++ decode step writes their rows itself with a copy of it
(kernels/paged_kv.h, PagedKV::write_row), byte for byte the same (tests/test_kv_store.py), and
dequantizes them inside its attention loop.
"""

from __future__ import annotations

import torch

from expresslane import names
from expresslane.errors import InvalidRequestError
from expresslane.kernels.constants import KVKind
from expresslane.quant.formats import (
    E2M1_MAX,
    E4M3_MAX,
    e2m1_decode,
    e2m1_encode,
    pack_nibbles,
    unpack_nibbles,
)

KV_CACHE_DTYPES = names.KV_CACHE_DTYPES


class PlainKV:
    def __init__(self, num_kv_heads: int, slots: int, head_dim: int, dtype, device):
        self.tensor = torch.zeros(2, num_kv_heads, slots, head_dim, dtype=dtype, device=device)

    @classmethod
    def wrap(cls, tensor: torch.Tensor) -> PlainKV:
        store = cls.__new__(cls)
        store.tensor = tensor
        return store

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_kv_heads * head_dim * dtype.itemsize

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [T, Hkv, D]."""
        self.tensor[0].index_copy_(1, slots, k.transpose(0, 1))
        self.tensor[1].index_copy_(1, slots, v.transpose(0, 1))

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        return self.tensor.index_select(2, slots)

    NATIVE_KIND = KVKind.PLAIN  # how the C++ kernels (kernels/paged_kv.h) read `native()`

    def native(self) -> list[torch.Tensor] | None:
        """What the C++ decode step reads (it computes in float32), or None."""
        return [self.tensor] if self.tensor.dtype == torch.float32 else None


class Bf16KV(PlainKV):
    """bf16 storage whatever the compute dtype; reads widen to the compute dtype."""

    def __init__(self, num_kv_heads: int, slots: int, head_dim: int, dtype, device):
        super().__init__(num_kv_heads, slots, head_dim, torch.bfloat16, device)
        self.dtype = dtype

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return PlainKV.bytes_per_token(num_kv_heads, head_dim, torch.bfloat16)

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        # the reference: PagedKV::write_row (kernels/paged_kv.h) rounds to nearest, ties even
        super().write(k.to(torch.bfloat16), v.to(torch.bfloat16), slots)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        return super().read(slots).to(self.dtype)

    NATIVE_KIND = KVKind.BF16

    def native(self) -> list[torch.Tensor] | None:
        """The C++ decode step widens the rows as it reads them (kernels/paged_kv.h)."""
        return [self.tensor] if self.dtype == torch.float32 else None


class Fp8KV:
    tensor = None  # no plain tensor

    def __init__(self, num_kv_heads: int, slots: int, head_dim: int, dtype, device):
        self.dtype = dtype
        # E4M3 bits kept as uint8: index_copy_ has no float8 kernel on CPU
        self.values = torch.zeros(
            2, num_kv_heads, slots, head_dim, dtype=torch.uint8, device=device
        )
        self.scales = torch.ones(2, num_kv_heads, slots, 1, dtype=torch.float16, device=device)

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_kv_heads * (head_dim + 2)

    def write(self, k, v, slots) -> None:
        # the reference: PagedKV::write_fp8 (kernels/paged_kv.h) must round exactly so
        x = torch.stack((k, v)).transpose(1, 2).float()  # [2, Hkv, T, D]
        # the floor is float16's smallest step: a zero row gets a nonzero scale (zero codes)
        scale = (x.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp(min=2**-24).half()
        e4m3 = (x / scale.float()).to(torch.float8_e4m3fn)
        self.values.index_copy_(2, slots, e4m3.view(torch.uint8))
        self.scales.index_copy_(2, slots, scale)

    def read(self, slots) -> torch.Tensor:
        values = self.values.index_select(2, slots).view(torch.float8_e4m3fn).float()
        return (values * self.scales.index_select(2, slots).float()).to(self.dtype)

    NATIVE_KIND = KVKind.FP8

    def native(self) -> list[torch.Tensor] | None:
        """The C++ decode step writes and reads these the same way (kernels/paged_kv.h)."""
        return [self.values, self.scales] if self.dtype == torch.float32 else None


class Fp4KV:
    tensor = None
    BLOCK = 16

    def __init__(self, num_kv_heads: int, slots: int, head_dim: int, dtype, device):
        if head_dim % self.BLOCK:
            raise ValueError(f"fp4 KV needs a head dim divisible by {self.BLOCK}")
        self.dtype = dtype
        nb = head_dim // self.BLOCK
        self.codes = torch.zeros(
            2, num_kv_heads, slots, head_dim // 2, dtype=torch.uint8, device=device
        )
        self.scales = torch.zeros(2, num_kv_heads, slots, nb, dtype=torch.uint8, device=device)

    @classmethod
    def bytes_per_token(cls, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_kv_heads * (head_dim // 2 + head_dim // cls.BLOCK)

    def write(self, k, v, slots) -> None:
        # the reference: PagedKV::write_fp4 (kernels/paged_kv.h) must round exactly so
        x = torch.stack((k, v)).transpose(1, 2).float()  # [2, Hkv, T, D]
        two, hkv, t, d = x.shape
        blocks = x.reshape(two, hkv, t, d // self.BLOCK, self.BLOCK)
        scale = (blocks.abs().amax(-1) / E2M1_MAX).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        s = scale.float().unsqueeze(-1)
        codes = e2m1_encode(torch.where(s > 0, blocks / torch.where(s > 0, s, 1.0), 0.0))
        codes = codes.reshape(two, hkv, t, d)
        self.codes.index_copy_(2, slots, pack_nibbles(codes))
        self.scales.index_copy_(2, slots, scale.view(torch.uint8))

    def read(self, slots) -> torch.Tensor:
        packed = self.codes.index_select(2, slots)
        values = e2m1_decode(unpack_nibbles(packed))
        two, hkv, n, d = values.shape
        scales = self.scales.index_select(2, slots).view(torch.float8_e4m3fn).float()
        out = values.view(two, hkv, n, d // self.BLOCK, self.BLOCK) * scales.unsqueeze(-1)
        return out.view(two, hkv, n, d).to(self.dtype)

    NATIVE_KIND = KVKind.FP4

    def native(self) -> list[torch.Tensor] | None:
        """The C++ decode step writes and reads these the same way (kernels/paged_kv.h)."""
        return [self.codes, self.scales] if self.dtype == torch.float32 else None


STORES = {"plain": PlainKV, "fp8": Fp8KV, "fp4": Fp4KV, "bfloat16": Bf16KV}


def store_name(kv_cache_dtype: str, model_dtype: str, compute: torch.dtype) -> str:
    """The STORES key a `kv_cache_dtype` takes for a model of `model_dtype` (the dtype asked
    for, or the checkpoint's under dtype="auto") computed in `compute`."""
    if kv_cache_dtype == "auto":
        keep_bf16 = compute == torch.float32 and model_dtype == "bfloat16"
        return "bfloat16" if keep_bf16 else "plain"
    if kv_cache_dtype == "float32":
        if compute != torch.float32:
            raise InvalidRequestError(
                f"kv_cache_dtype float32 needs float32 compute; this model computes in {compute}"
            )
        return "plain"
    return kv_cache_dtype
