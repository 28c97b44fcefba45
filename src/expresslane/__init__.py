"""expresslane: one LLM served in tiers (ultrafast, default, flex) over the OpenAI API."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["LLM", "Output", "SamplingParams"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from expresslane.llm import LLM, Output
    from expresslane.sampling_params import SamplingParams

# Loaded on first use, so the command line (`expresslane --help`) does not import torch.
_LAZY = {
    "LLM": "expresslane.llm",
    "Output": "expresslane.llm",
    "SamplingParams": "expresslane.sampling_params",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'expresslane' has no attribute {name!r}")
