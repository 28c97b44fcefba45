"""Typed configuration. `EngineConfig` is what `LLM(**options)` and `expresslane serve` flags
fill in; defaults suit the bundled demo model on a small CPU machine."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch

from expresslane.errors import InvalidRequestError


@dataclass
class EngineConfig:
    model: str | None = None  # Hugging Face-format directory; None: the bundled demo model
    tokenizer: str | None = None  # defaults to the model directory
    device: str = "auto"  # "auto": cuda if available, else cpu
    dtype: str = "auto"  # "auto": the checkpoint's dtype, or float32 on CPUs without fast bf16
    max_model_len: int | None = None  # default: min(config's max positions, 8192)
    block_size: int = 16
    kv_cache_memory_gb: float = 1.0
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_gb
    max_batch: int = 64  # max sequences per step
    max_num_batched_tokens: int = 512  # token budget per step (prefill chunk size)
    enable_prefix_caching: bool = True
    batch_invariant: bool = False  # every step in row-invariant kernels (kernels/plan.py)
    # decode steps replay graphs captured per batch-size and context bucket (CUDA graphs on a
    # GPU; on a CPU the same steps run eagerly): engine/decode_graphs.py
    cuda_graphs: bool = False
    seed: int | None = None
    speculative: dict | None = None  # every lane's, unless the lane sets its own
    lanes: dict | None = None  # {lane: {setting: value}} over the defaults in lanes.py
    calibrate: bool = True  # time synthetic steps at server start for the step-latency model
    # the folder calibrations are kept in for the next start (engine/calibration_cache.py);
    # None: $EXPRESSLANE_CALIBRATION_CACHE, else ~/.cache/expresslane/calibration; "off": none
    calibration_cache: str | None = None
    quantization: str | None = None  # "nvfp4" / "mxfp4": quantize linear weights at load
    kv_cache_dtype: str = "auto"  # the model's dtype; float32, bfloat16, fp8, fp4 (kv_store.py)
    max_queue_seconds: float | None = None  # not started by then: fails (serve: 60 s)
    max_waiting: int | None = None  # requests that may wait; one more fails (serve: 4096)
    tensor_parallel_size: int = 1  # processes the model's layers are split over (engine/parallel)

    @classmethod
    def from_options(cls, model: str | None, options: dict) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown option(s) {unknown}; known: {sorted(known - {'model'})}"
            )
        config = cls(model=model, **options)
        from expresslane.quant.formats import FORMATS

        if config.quantization is not None and config.quantization not in FORMATS:
            raise InvalidRequestError(
                f"unknown quantization {config.quantization!r}; choose from {sorted(FORMATS)}"
            )
        size = config.tensor_parallel_size
        if not isinstance(size, int) or size < 1:
            raise InvalidRequestError(f"tensor_parallel_size must be 1 or more, not {size!r}")
        from expresslane.models.kv_store import KV_CACHE_DTYPES

        if config.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(
                f"unknown kv_cache_dtype {config.kv_cache_dtype!r}; choose from {KV_CACHE_DTYPES}"
            )
        return config

    @property
    def model_dir(self) -> Path:
        from expresslane.demo import demo_model_dir
        from expresslane.model_source import resolve_model

        return resolve_model(self.model) if self.model else demo_model_dir()

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
