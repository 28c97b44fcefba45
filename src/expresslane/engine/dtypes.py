"""Which dtypes a model runs in on this machine: the compute dtype and the linear weights'
storage dtype, from the dtype the user asked for and the checkpoint's. On a CPU the answer
depends on the kernels this machine has (it builds them if need be), so it is decided when the
engine loads a model, not when its config is read."""

from __future__ import annotations

import torch

from expresslane.config import EngineConfig
from expresslane.errors import InvalidRequestError
from expresslane.kernels.plan import compute_dtypes
from expresslane.names import DTYPES

_DTYPES = {name: getattr(torch, torch_name) for name, torch_name in DTYPES.items()}


def model_dtypes(
    config: EngineConfig, checkpoint_dtype: str, device: torch.device
) -> tuple[torch.dtype, torch.dtype]:
    """(compute dtype, linear weight storage dtype)."""
    name = config.dtype if config.dtype != "auto" else checkpoint_dtype
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise InvalidRequestError(f"unknown dtype {name!r}; use bfloat16, float16 or float32")
    return compute_dtypes(dtype, config.dtype == "auto", device)
