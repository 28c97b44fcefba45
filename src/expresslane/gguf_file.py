"""A GGUF file (llama.cpp's format) read as a Hugging Face checkpoint: its metadata as a
`config.json`, its tensors under Hugging Face names. Linear weights in 4-bit blocks (Q4_0,
Q4_1, Q4_K) stay 4-bit (`Int4Weight`, quant/int4.py); every other tensor, the token embeddings
included, is dequantized by the `gguf` package and widened. `EXPRESSLANE_GGUF_4BIT=0` widens
the 4-bit ones too.

llama.cpp's converter permutes the rows of a Llama model's q and k projections (its RoPE pairs
neighbouring values, Hugging Face's pairs the two halves); `_unpermute` undoes it, as
transformers' GGUF loader does, so the tensors are what the Hugging Face checkpoint held.
"""

from __future__ import annotations

import os
import re
from functools import partial
from pathlib import Path

import numpy as np
import torch

from expresslane.errors import ModelLoadError
from expresslane.quant.gguf_blocks import INT4_TYPES, int4_from_gguf
from expresslane.quant.int4 import Int4Weight

# GGUF architecture -> (Hugging Face architecture, q/k rows permuted by the converter)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "gemma3": ("Gemma3ForCausalLM", False),
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3's norms around attention and the MLP; llama.cpp's converter stores its norm weights
# with the 1 of (1 + weight) added, which `NORM_SHIFT` takes off again
_GEMMA3_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
LAYER_NAMES = {"gemma3": _GEMMA3_NAMES}
NORM_SHIFT = {"gemma3": 1.0}
GEMMA3_SLIDING_PATTERN = 6  # llama.cpp's: every sixth layer attends globally
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
KEEP_4BIT_ENV = "EXPRESSLANE_GGUF_4BIT"
# Linear layers (by GGUF name) whose 4-bit blocks are kept; the embeddings are a lookup
_LINEARS = {
    *("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"),
    "output.weight",
}


class GgufFile:
    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            self.reader = GGUFReader(self.path)
        except (ValueError, OSError) as e:
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: {e}") from e
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ModelLoadError(
                f"{self.path.name}: unsupported GGUF architecture {self.arch!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def _arch_field(self, key: str, default=None):
        return self.field(f"{self.arch}.{key}", default)

    def config(self) -> dict:
        """The Hugging Face `config.json` this file's metadata describes."""
        heads = self._arch_field("attention.head_count")
        hidden = self._arch_field("embedding_length")
        tensors = {t.name for t in self.reader.tensors}
        vocab = self._arch_field("vocab_size") or len(self.field("tokenizer.ggml.tokens"))
        cfg = {
            "architectures": [ARCHITECTURES[self.arch][0]],
            "model_type": self.arch,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": self._arch_field("feed_forward_length"),
            "num_hidden_layers": self._arch_field("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._arch_field("attention.head_count_kv", heads),
            "head_dim": self._arch_field("attention.key_length", hidden // heads),
            "rms_norm_eps": self._arch_field("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self._arch_field("rope.freq_base", 10000.0),
            "max_position_embeddings": self._arch_field("context_length", 2048),
            "tie_word_embeddings": "output.weight" not in tensors,
            "attention_bias": "blk.0.attn_q.bias" in tensors,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
            "torch_dtype": "bfloat16",
        }
        scaling = self._rope_scaling()
        if scaling:
            cfg["rope_scaling"] = scaling
        if self.arch == "gemma3":
            cfg.update(self._gemma3(cfg))
        return cfg

    def _gemma3(self, cfg: dict) -> dict:
        """Gemma 3's settings beyond the Llama block's (models/config.py reads them)."""
        full = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
        full.update(cfg.pop("rope_scaling", None) or {})
        return {
            "model_type": "gemma3_text",
            "sliding_window": self._arch_field("attention.sliding_window"),
            "sliding_window_pattern": GEMMA3_SLIDING_PATTERN,
            "query_pre_attn_scalar": cfg["head_dim"],
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_parameters": {
                "full_attention": full,
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        }

    def _rope_scaling(self) -> dict | None:
        freqs = next((t for t in self.reader.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is not None:  # llama.cpp's llama3 scaling: a factor per frequency
            return {"rope_type": "frequency_factors", "factors": _dequantize(freqs).tolist()}
        kind = self._arch_field("rope.scaling.type")
        if kind in (None, "none"):
            return None
        scaling = {"rope_type": kind, "factor": self._arch_field("rope.scaling.factor", 1.0)}
        original = self._arch_field("rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = original
        return scaling

    def tensors(
        self, dtype: torch.dtype = torch.bfloat16, keep_4bit: bool | None = None
    ) -> dict[str, torch.Tensor | Int4Weight]:
        """Every tensor under its Hugging Face name: linear weights in 4-bit blocks as
        `Int4Weight`s where `keep_4bit` (default: unless $EXPRESSLANE_GGUF_4BIT is 0), other
        matrices widened to `dtype`, vectors (norms, biases) to float32."""
        if keep_4bit is None:
            keep_4bit = os.environ.get(KEEP_4BIT_ENV, "1") != "0"
        permuted = ARCHITECTURES[self.arch][1]
        heads = self._arch_field("attention.head_count")
        kv_heads = self._arch_field("attention.head_count_kv", heads)
        out = {}
        for t in self.reader.tensors:
            if t.name == "rope_freqs.weight":  # in the config, as rope scaling
                continue
            name, kind = _hf_name(t.name, LAYER_NAMES.get(self.arch, _LAYER_NAMES))
            values = _read(t, kind, keep_4bit)
            if name.endswith("norm.weight") and self.arch in NORM_SHIFT:
                values = values - NORM_SHIFT[self.arch]
            if permuted and kind in ("attn_q", "attn_k") and name.endswith(".weight"):
                rows = partial(_unpermute, heads=heads if kind == "attn_q" else kv_heads)
                values = values.map_rows(rows) if isinstance(values, Int4Weight) else rows(values)
            if isinstance(values, torch.Tensor):
                values = values.to(dtype if values.dim() == 2 else torch.float32)
            out[name] = values
        return out


def _hf_name(name: str, layer_names: dict[str, str]) -> tuple[str, str]:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name], name
    m = _LAYER.fullmatch(name)
    if m is None or m.group(2) not in layer_names:
        raise ModelLoadError(f"GGUF tensor {name!r} has no Hugging Face counterpart here")
    layer, kind, suffix = m.groups()
    return f"model.layers.{layer}.{layer_names[kind]}.{suffix}", kind


def _read(t, kind: str, keep_4bit: bool) -> torch.Tensor | Int4Weight:
    """A linear weight in 4-bit blocks as they are (where kept), anything else dequantized."""
    linear = kind in _LINEARS and t.data.ndim == 2
    if keep_4bit and linear and t.tensor_type.name in INT4_TYPES:
        return int4_from_gguf(t.data, t.tensor_type.name)
    return torch.from_numpy(_dequantize(t))


def _dequantize(t) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.array(t.data)  # a copy: the file is mapped read-only
    try:
        return quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ModelLoadError(
            f"GGUF tensor {t.name}: type {t.tensor_type.name} cannot be read"
        ) from e


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (per head: interleaved pairs -> two halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
