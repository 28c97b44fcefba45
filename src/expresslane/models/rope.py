"""RoPE frequencies: a checkpoint's rope scaling turned into inverse frequencies and the
attention factor that multiplies cos and sin, in float32 as transformers computes them.

The paged KV cache fixes each position's rotation when its keys are written, so a table never
changes while the engine runs. Two types that transformers recomputes from the current sequence
length are therefore chosen once, by how long the engine serves (`max_positions`), as vLLM
chooses LongRoPE's factors by its `max_model_len`:

- `dynamic` (NTK): up to `max_position_embeddings` (the pretraining length, which transformers'
  dynamic NTK takes as its original length) the plain table, equal to transformers for every
  sequence; served longer, vLLM's `DynamicNTKScalingRotaryEmbedding` table, whose base is scaled
  for `factor` x that length and shared by all positions.
- `longrope`: up to `original_max_position_embeddings` the short factors, equal to transformers
  for every sequence; served longer, the long factors for all positions, equal to transformers
  on sequences past the original length (vLLM's `Phi3LongRoPEScaledRotaryEmbedding`).

A table split by position (plain below the length, scaled past it) would equal transformers on
short sequences whatever the engine serves, but would rotate a query past the length and a key
before it by different frequencies, which RoPE's relative positions do not survive.

`linear`, `llama3` and `yarn` do not depend on the length and equal transformers everywhere.
`frequency_factors` is llama.cpp's form of scaling (a GGUF's `rope_freqs` tensor: each
frequency divided by its factor, as Llama 3.1's GGUF files carry their llama3 scaling).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from expresslane.errors import ModelLoadError

if TYPE_CHECKING:
    from expresslane.models.config import ModelConfig

SUPPORTED_ROPE_SCALING = ("linear", "llama3", "yarn", "dynamic", "longrope", "frequency_factors")
_REQUIRED = {
    "frequency_factors": ("factors",),
    "linear": ("factor",),
    "llama3": ("factor",),
    "dynamic": ("factor",),
    "longrope": ("short_factor", "long_factor"),
}


def parse_rope_scaling(raw: dict, max_position_embeddings: int) -> dict | None:
    """The rope scaling of a config.json (`rope_scaling`, or transformers 5's `rope_parameters`)
    with `rope_type` set, or None for plain RoPE."""
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    if kind not in SUPPORTED_ROPE_SCALING:
        raise ModelLoadError(
            f"unsupported rope scaling {kind!r}; supported: {', '.join(SUPPORTED_ROPE_SCALING)}"
        )
    missing = [key for key in _REQUIRED.get(kind, ()) if scaling.get(key) is None]
    if missing:
        raise ModelLoadError(f"{kind} rope scaling needs {', '.join(missing)} in config.json")
    scaling = dict(scaling, rope_type=kind)
    if kind in ("llama3", "yarn", "longrope"):
        # Phi-3 keeps the pretraining length at the top level; transformers lets that one win.
        scaling["original_max_position_embeddings"] = (
            raw.get("original_max_position_embeddings")
            or scaling.get("original_max_position_embeddings")
            or max_position_embeddings
        )
    return scaling


def rope_frequencies(
    cfg: ModelConfig, max_positions: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32) and the factor on cos and sin for a table of
    `max_positions` rows (default: the checkpoint's `max_position_embeddings`)."""
    scaling = cfg.rope_scaling
    if scaling is None:
        return plain_inv_freq(cfg.rope_theta, cfg.head_dim), 1.0
    max_positions = max_positions or cfg.max_position_embeddings
    return _SCALINGS[scaling["rope_type"]](cfg, scaling, max_positions)


def rope_inv_freq(cfg: ModelConfig, max_positions: int | None = None) -> torch.Tensor:
    """Inverse RoPE frequencies (float32, computed as transformers does), scaling applied."""
    return rope_frequencies(cfg, max_positions)[0]


def plain_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _linear(cfg: ModelConfig, s: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    return plain_inv_freq(cfg.rope_theta, cfg.head_dim) / s["factor"], 1.0


def _frequency_factors(cfg: ModelConfig, s: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    factors = torch.tensor(s["factors"], dtype=torch.float32)
    return plain_inv_freq(cfg.rope_theta, cfg.head_dim) / factors, 1.0


def _llama3(cfg: ModelConfig, s: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    inv = plain_inv_freq(cfg.rope_theta, cfg.head_dim)
    factor = s["factor"]
    low_ff = s.get("low_freq_factor", 1.0)
    high_ff = s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low_ff, inv / factor, inv)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high_ff) & (wavelen <= old_len / low_ff)
    return torch.where(medium, smoothed, scaled), 1.0


def _dynamic(cfg: ModelConfig, s: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    dim, base, original = cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings
    if max_positions > original:
        factor = s["factor"]
        max_len = factor * original
        base = base * (factor * max_len / original - (factor - 1)) ** (dim / (dim - 2))
    return plain_inv_freq(base, dim), 1.0


def _longrope(cfg: ModelConfig, s: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    dim, original = cfg.head_dim, s["original_max_position_embeddings"]
    key = "long_factor" if max_positions > original else "short_factor"
    if len(s[key]) != dim // 2:
        raise ModelLoadError(
            f"longrope {key} has {len(s[key])} entries; head_dim {dim} needs {dim // 2}"
        )
    ext = torch.tensor(s[key], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv = 1.0 / (ext * cfg.rope_theta**shape)
    attention = s.get("attention_factor")
    if attention is None:
        factor = _factor(cfg, s)
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return inv, attention


def _yarn(cfg: ModelConfig, s: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    dim, base = cfg.head_dim, cfg.rope_theta
    factor = _factor(cfg, s)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    low, high = _yarn_correction_range(s, dim, base)
    if low == high:
        high += 0.001  # a ramp of width zero would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # high-frequency dims extrapolate (keep their frequency), low ones interpolate
    inv = interpolated * (1 - keep) + extrapolated * keep
    return inv, _yarn_attention_factor(s, factor)


def _yarn_correction_range(s: dict, dim: int, base: float) -> tuple[float, float]:
    """The dims between which YaRN ramps from extrapolation to interpolation: those that
    turn `beta_fast` and `beta_slow` times over the original length."""
    original = s["original_max_position_embeddings"]

    def dim_for(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for(s.get("beta_fast") or 32), dim_for(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn_attention_factor(s: dict, factor: float) -> float:
    if s.get("attention_factor") is not None:
        return s["attention_factor"]
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all_dim:  # DeepSeek's form
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return (0.1 * mscale * math.log(scale) + 1.0) if scale > 1 else 1.0


def _factor(cfg: ModelConfig, s: dict) -> float:
    """`factor`, or where a config leaves it out `max_position_embeddings` over the original."""
    if s.get("factor") is not None:
        return s["factor"]
    return cfg.max_position_embeddings / s["original_max_position_embeddings"]


_SCALINGS = {
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
    "dynamic": _dynamic,
    "longrope": _longrope,
    "frequency_factors": _frequency_factors,
}
