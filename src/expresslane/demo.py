"""The bundled demo model (assets/demo: tokenizer, config and trained weights).

When the trained weights are not there (they are produced by scripts/train_demo_model.py), a
checkpoint with random weights of the same architecture and the real tokenizer is created
once under ~/.cache/expresslane, so the server and `LLM()` still start; the output is then
meaningless, and a warning says so."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

ASSETS = Path(__file__).parent / "assets" / "demo"
TARGET_DIR = ASSETS / "target"
DRAFT_DIR = ASSETS / "draft"
log = logging.getLogger("expresslane")


def has_weights(model_dir: Path) -> bool:
    return any(model_dir.glob("*.safetensors"))


def demo_model_dir(which: Path = TARGET_DIR) -> Path:
    if has_weights(which):
        return which
    log.warning(
        "the demo model's trained weights are not installed (%s): using random weights of "
        "its architecture; outputs will be meaningless. Train them with "
        "python -m scripts.train_demo_model or pass --model DIR.",
        which,
    )
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    out = cache / "expresslane" / f"demo-{which.name}-random"
    if not has_weights(out):
        write_random_checkpoint(which, out)
    return out


def write_random_checkpoint(src: Path, out: Path, seed: int = 0) -> None:
    """Copy config and tokenizer files from `src` and add seeded random Llama weights."""
    from safetensors.torch import save_file

    cfg = json.loads((src / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix == ".json":
            shutil.copy(f, out / f.name)
    g = torch.Generator().manual_seed(seed)
    d, ffn, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = (
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
    )
    head_dim = cfg.get("head_dim") or d // heads

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    w = {
        "model.embed_tokens.weight": rand(vocab, d),
        "model.norm.weight": torch.ones(d, dtype=torch.bfloat16),
    }
    if not cfg.get("tie_word_embeddings", False):
        w["lm_head.weight"] = rand(vocab, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, d)
        w[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, d)
        w[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, d)
        w[p + "self_attn.o_proj.weight"] = rand(d, heads * head_dim)
        w[p + "mlp.gate_proj.weight"] = rand(ffn, d)
        w[p + "mlp.up_proj.weight"] = rand(ffn, d)
        w[p + "mlp.down_proj.weight"] = rand(d, ffn)
        w[p + "input_layernorm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        w[p + "post_attention_layernorm.weight"] = torch.ones(d, dtype=torch.bfloat16)
    save_file(w, str(out / "model.safetensors"))
