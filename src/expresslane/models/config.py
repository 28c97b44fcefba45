"""The subset of a Hugging Face `config.json` that the Llama-family runtime needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from expresslane.errors import ModelLoadError
from expresslane.models import gpt_oss
from expresslane.models.moe import MoEConfig
from expresslane.models.rope import parse_rope_scaling
from expresslane.models.rope import rope_inv_freq as rope_inv_freq  # where it was defined before

# Architectures that share the Llama block; they differ only in the flags below (and the
# mixtures of experts in their feed-forward blocks: models/moe.py).
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Gemma3ForCausalLM",
    gpt_oss.ARCHITECTURE,
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
    moe: MoEConfig | None = None  # mixture-of-experts feed-forward blocks
    # Gemma 3's departures from the Llama block (`_gemma3`; gpt-oss's windows too):
    layer_windows: list[int | None] | None = None  # per layer: its sliding window, or None
    local_rope_theta: float | None = None  # the RoPE base of the sliding-window layers
    norm_offset: float = 0.0  # norms scale by (offset + weight)
    sandwich_norms: bool = False  # norms after attention and after the MLP as well
    embed_scale: float = 1.0  # on the token embeddings
    activation: str = "silu"  # of the MLP's gate: silu or gelu_tanh
    query_scale: float = 1.0  # on q, so that attention scores scale by another than D**-0.5

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
        mistral = arch in ("MistralForCausalLM", "MixtralForCausalLM")
        use_sliding = raw.get("use_sliding_window", mistral)
        max_position_embeddings = raw.get("max_position_embeddings", 2048)
        family = _FAMILY_SETTINGS[arch](raw) if arch in _FAMILY_SETTINGS else {}
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
            rope_theta=family.pop("rope_theta", None) or _rope_theta(raw),
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            rope_scaling=parse_rope_scaling(
                family.pop("global_rope", raw), max_position_embeddings
            ),
            sliding_window=raw.get("sliding_window") if use_sliding else None,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            moe=family.pop("moe", None) or MoEConfig.from_dict(raw, arch),
            **family,
        )


def _rope_theta(raw: dict) -> float:
    params = raw.get("rope_parameters") or {}
    return float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _gemma3(raw: dict) -> dict:
    """Gemma 3's settings: sliding-window layers (`layer_types`, else 5 of every 6) with their
    own RoPE base, (1 + weight) norms before and after attention and the MLP, embeddings
    scaled by sqrt(hidden), gelu-tanh, scores scaled by query_pre_attn_scalar**-0.5. The
    global layers' RoPE (and scaling) come from `rope_parameters["full_attention"]` (older
    configs: `rope_theta`, `rope_local_base_freq` and `rope_scaling`)."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(key):
            raise ModelLoadError(f"Gemma models with {key} are not supported")
    layers = raw["num_hidden_layers"]
    pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    window = raw["sliding_window"]
    params = raw.get("rope_parameters") or {}
    full = params.get("full_attention") or {}
    local = params.get("sliding_attention") or {}
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    return {
        "layer_windows": [window if t == "sliding_attention" else None for t in types],
        "local_rope_theta": float(
            local.get("rope_theta") or raw.get("rope_local_base_freq") or 1e4
        ),
        "rope_theta": float(full.get("rope_theta") or raw.get("rope_theta") or 1e6),
        "global_rope": {"rope_scaling": full or raw.get("rope_scaling")},
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "embed_scale": raw["hidden_size"] ** 0.5,
        "activation": "gelu_tanh",
        "query_scale": (raw.get("query_pre_attn_scalar") or head_dim) ** -0.5 * head_dim**0.5,
    }


_FAMILY_SETTINGS = {"Gemma3ForCausalLM": _gemma3, gpt_oss.ARCHITECTURE: gpt_oss.settings}
