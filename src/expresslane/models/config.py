"""The subset of a Hugging Face `config.json` that the Llama-family runtime needs."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from expresslane.errors import ModelLoadError

# Architectures that share the Llama block; they differ only in the flags below.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2)
    qk_norm: bool  # RMSNorm on q and k per head (Qwen3)
    rope_scaling: dict | None = None
    sliding_window: int | None = None
    torch_dtype: str = "float32"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        if not Path(model_dir).is_dir():
            raise ModelLoadError(f"model directory {model_dir} does not exist")
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(
                f"{model_dir} has no config.json; expected a Hugging Face model directory"
            )
        raw = json.loads(path.read_text())
        return cls.from_dict(raw, model_dir)

    @classmethod
    def from_dict(cls, raw: dict, model_dir: str | Path = "") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or raw.get('model_type')!r} in {model_dir}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        eos = raw.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        use_sliding = raw.get("use_sliding_window", arch == "MistralForCausalLM")
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope_scaling=_rope_scaling(raw),
            sliding_window=raw.get("sliding_window") if use_sliding else None,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )


def _rope_theta(raw: dict) -> float:
    params = raw.get("rope_parameters") or {}
    return float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict) -> dict | None:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("llama3", "linear"):
        raise ModelLoadError(f"unsupported rope scaling {kind!r}; supported: llama3, linear")
    return dict(scaling, rope_type=kind)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies (float32, computed as transformers does), scaling applied."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv
    if scaling["rope_type"] == "linear":
        return inv / scaling["factor"]
    factor = scaling["factor"]
    low_ff = scaling.get("low_freq_factor", 1.0)
    high_ff = scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low_ff, inv / factor, inv)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high_ff) & (wavelen <= old_len / low_ff)
    return torch.where(medium, smoothed, scaled)
