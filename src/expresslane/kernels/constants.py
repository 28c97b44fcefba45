"""The integers that cross the Python/C++ boundary, named: this module and
kernels/constants.h hold the same values (tests/test_kernels.py checks the compiled module's
KV_KIND_*, SCALE_KIND_* and EXPERT_ACTIVATION_* against these). Readable without the compiled
kernels: the Triton kernel and the PyTorch paths use them too."""

from __future__ import annotations

from enum import IntEnum


class KVKind(IntEnum):
    """How a layer's KV cache is stored (models/kv_store.py: each store's NATIVE_KIND)."""

    PLAIN = 0  # float32 [2, Hkv, slots, D]
    FP8 = 1  # E4M3 bytes + a float16 scale per head vector
    FP4 = 2  # E2M1 codes + an E4M3 scale per 16 values
    BF16 = 3  # bf16 [2, Hkv, slots, D]


class ScaleKind(IntEnum):
    """How an FP4 weight's block-scale bytes are read (quant/formats.py: kernel_scale_kind)."""

    E8M0 = 0  # MXFP4: a power of two, the byte is the exponent + 127
    E4M3 = 1  # NVFP4: FP8 E4M3 bits


class ExpertActivation(IntEnum):
    """An expert's activation between its gate_up and down linears (models/moe.py)."""

    SWIGLU = 0  # silu(gate) * up, gate the first half of gate_up's outputs (Qwen3-MoE, Mixtral)
    CLAMPED_SWIGLU = 1  # gpt-oss: gate and up interleaved, clamped, (up + 1) * gate * sigmoid
