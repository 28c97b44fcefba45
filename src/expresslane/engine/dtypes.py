"""Which dtypes a model runs in on this machine: the compute dtype and the linear weights'
storage dtype, from the dtype the user asked for and the checkpoint's. On a CPU the answer
depends on the kernels this machine has (it builds them if need be), so it is decided when the
engine loads a model, not when its config is read."""

from __future__ import annotations

import torch

from expresslane.config import EngineConfig
from expresslane.errors import InvalidRequestError
from expresslane.names import DTYPES

_DTYPES = {name: getattr(torch, torch_name) for name, torch_name in DTYPES.items()}


def model_dtypes(
    config: EngineConfig, checkpoint_dtype: str, device: torch.device
) -> tuple[torch.dtype, torch.dtype]:
    """(compute dtype, linear weight storage dtype)."""
    from expresslane.kernels import cpu_kernels
    from expresslane.models.layers import onednn_prepack_supported

    name = config.dtype if config.dtype != "auto" else checkpoint_dtype
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise InvalidRequestError(f"unknown dtype {name!r}; use bfloat16, float16 or float32")
    # On CPU, a bf16 checkpoint computes in float32 and keeps its bf16 linear weights:
    # decode batches run the native step, which reads the bf16 bytes and sums in float32
    # (with AVX-512 BF16, products of bf16-rounded activations): 141 against 69 tok/s
    # for bf16 compute at batch 1 on an AVX-512 BF16 CPU (SmolLM2-135M); there every step
    # runs the native kernels, elsewhere larger matmuls run oneDNN (`Linear.prepare_cpu`).
    # A half dtype without kernels computes in float32 only where its matmuls are slow
    # (no AVX-512).
    upcast = config.dtype == "auto" and device.type == "cpu" and dtype != torch.float32
    if upcast and (
        (dtype == torch.bfloat16 and cpu_kernels() is not None)
        or not onednn_prepack_supported(dtype)
    ):
        return torch.float32, dtype if dtype == torch.bfloat16 else torch.float32
    return dtype, dtype
