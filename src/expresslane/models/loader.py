"""Load a Hugging Face-format directory (config.json + safetensors, sharded or not) into a
`LlamaModel`, fusing QKV and gate/up projections on the way."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch

from expresslane.checkpoint import read_checkpoint
from expresslane.errors import ModelLoadError
from expresslane.models import gpt_oss
from expresslane.models.config import ModelConfig
from expresslane.models.llama import LlamaModel
from expresslane.models.moe import EXPERT_NAMES, expert_weights
from expresslane.models.shard import Shard
from expresslane.quant.checkpoint import QUANT_METHOD, quantize_tensors, read_fp4_weights
from expresslane.quant.int4 import Int4Weight
from expresslane.quant.linear import Fp4Weight
from expresslane.quant.mxfp4_experts import (
    is_mxfp4_experts,
    quantize_checkpoint,
    read_mxfp4_experts,
)

_RENAMES = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_norm",
    "self_attn.o_proj.weight": "o",
    "mlp.down_proj.weight": "down",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "self_attn.o_proj.bias": "o_bias",  # gpt-oss
    "self_attn.sinks": "sinks",  # gpt-oss
}
# Gemma's norms: one after attention, one before and one after the MLP (`sandwich_norms`)
_SANDWICH_RENAMES = {
    **_RENAMES,
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "post_norm",  # the norm the MLP's input takes
    "post_feedforward_layernorm.weight": "post_ffn_norm",
}
_NORMS = {"input_norm", "post_norm", "post_attn_norm", "post_ffn_norm", "q_norm", "k_norm"}
_FUSED = {
    "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "qkv_bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def fuse_weights(
    cfg: ModelConfig,
    raw: dict[str, torch.Tensor],
    dtype: torch.dtype,
    linear_dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Map Hugging Face names to the runtime's fused layout, cast to `dtype` (linear
    weights to `linear_dtype`, which defaults to `dtype`)."""
    linear_dtype = linear_dtype or dtype

    def take(name: str, to: torch.dtype = dtype) -> torch.Tensor:
        if name not in raw:
            raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
        t = raw[name]
        return t if isinstance(t, Fp4Weight | Int4Weight) else t.to(to)

    def norm(name: str) -> torch.Tensor:  # Gemma's (1 + weight), folded in float32
        return (take(name, torch.float32) + cfg.norm_offset).to(dtype)

    out = {"embed": take("model.embed_tokens.weight"), "norm": norm("model.norm.weight")}
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    out["lm_head"] = take(head, linear_dtype)
    linear = {"o", "down"}
    renames = _SANDWICH_RENAMES if cfg.sandwich_norms else _RENAMES
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for src, dst in renames.items():
            if p + src in raw:
                t = (
                    norm(p + src)
                    if dst in _NORMS
                    else take(p + src, linear_dtype if dst in linear else dtype)
                )
                out[f"layers.{i}.{dst}"] = t
        sparse = cfg.moe is not None and i not in cfg.moe.dense_layers
        if sparse:
            out.update(_experts(cfg, p, take, raw.keys(), linear_dtype, i))
        for dst, parts in _FUSED.items():
            if (dst == "qkv_bias" or sparse) and p + parts[0] not in raw:
                continue
            to = dtype if dst == "qkv_bias" else linear_dtype
            out[f"layers.{i}.{dst}"] = _fuse([take(p + s, to) for s in parts], to)
    return out


def _experts(cfg: ModelConfig, p: str, take, names, linear_dtype, i: int) -> dict:
    """Layer i's router (in the compute dtype) and experts (linears: `linear_dtype`)."""
    n = cfg.moe.num_experts
    if cfg.architecture == gpt_oss.ARCHITECTURE:
        tensors = gpt_oss.layer_weights(take, names, p, n, linear_dtype)
        return {f"layers.{i}.{k}": v for k, v in tensors.items()}
    router, prefix, expert_names = EXPERT_NAMES[cfg.architecture]
    tensors = {"router": take(p + router)}
    experts = partial(take, to=linear_dtype)
    tensors.update(expert_weights(experts, p + prefix, expert_names, n))
    return {f"layers.{i}.{k}": v for k, v in tensors.items()}


def _fuse(parts: list, dtype: torch.dtype):
    """One weight of the parts' rows: kept FP4 or 4-bit integer when every part is; else all
    widened to `dtype` (a GGUF may store v in 6 bits beside 4-bit q and k)."""
    for kind in (Fp4Weight, Int4Weight):
        if all(isinstance(p, kind) for p in parts):
            return kind.cat(parts)
    return torch.cat([p.to(dtype) if isinstance(p, Int4Weight) else p for p in parts])


_PLAIN = (torch.float32, torch.float16, torch.bfloat16)


def own_quant_config(config: dict, raw: dict[str, torch.Tensor]) -> dict | None:
    """The checkpoint's `quantization_config` if it is expresslane's; None when there is none
    or another tool's over tensors that are plain (transformers writes one of method `gguf`
    over the bf16 tensors it dequantized); otherwise an error naming the method."""
    qc = config.get("quantization_config")
    if not qc or qc.get("quant_method") == QUANT_METHOD:
        return qc
    plain = all(t.dtype in _PLAIN and n.endswith((".weight", ".bias")) for n, t in raw.items())
    if plain:
        return None
    raise ModelLoadError(
        f"the checkpoint's weights are quantized by {qc.get('quant_method')!r}, which expresslane "
        f"does not read; supported: {QUANT_METHOD!r} (`expresslane quantize`), GGUF files, and "
        "plain float32/float16/bf16 tensors"
    )


def _mxfp4_experts(cfg: ModelConfig, raw: dict, config: dict, quantization: str | None) -> bool:
    """Whether the experts are gpt-oss's in MXFP4, read into `raw` as FP4 weights: as OpenAI
    publishes them, or a bf16/float32 gpt-oss's quantized at load (`quantization="mxfp4"`)."""
    if not is_mxfp4_experts(config):
        if cfg.architecture != gpt_oss.ARCHITECTURE or quantization != "mxfp4":
            return False
        quantized = quantize_checkpoint(raw, config)
        raw.clear()
        raw.update(quantized)
    read_mxfp4_experts(raw)
    return True


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    linear_dtype: torch.dtype | None = None,
    quantization: str | None = None,
    shard: Shard | None = None,
) -> tuple[LlamaModel, ModelConfig]:
    """`dtype` is the compute dtype; on CPU, `linear_dtype=torch.bfloat16` with a float32
    `dtype` keeps bf16 linear weights for the small-batch kernel (see `Linear.prepare_cpu`).
    With `shard`, the model is that rank's part of a tensor-parallel model (its `cfg` this
    rank's heads and columns; the config returned is the whole model's)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    raw = read_checkpoint(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    mxfp4_experts = _mxfp4_experts(cfg, raw, config, quantization)
    quant_config = None if mxfp4_experts else own_quant_config(config, raw)
    if cfg.moe is not None and (quant_config or (quantization and not mxfp4_experts)):
        raise ModelLoadError(
            "FP4 weights for mixture-of-experts models are gpt-oss's MXFP4 experts only (as "
            "OpenAI publishes them, or quantization mxfp4 at load); serve this checkpoint's "
            "own bf16/float32 weights"
        )
    if quantization and not quant_config and not mxfp4_experts:
        raw, _ = quantize_tensors(raw, config, quantization)  # in memory, at load
        cfg.tie_word_embeddings = config.get("tie_word_embeddings", cfg.tie_word_embeddings)
        quant_config = config["quantization_config"]
    if quant_config:
        read_fp4_weights(raw, quant_config)
    weights = fuse_weights(cfg, raw, dtype, linear_dtype)
    model_cfg = cfg
    if shard is not None:
        shard.check(cfg)
        weights, model_cfg = shard.weights(cfg, weights), shard.config(cfg)
    weights = {k: v.to(device) for k, v in weights.items()}
    model = LlamaModel(model_cfg, weights, dtype, max_positions).to(device)
    model.allow_stack = shard is None
    if device.type == "cpu":
        model.prepare_cpu(dtype)
    return model.eval(), cfg
