"""Helpers shared by the benchmark scripts: random-weight checkpoints of real architectures."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "bench"

# SmolLM2-135M's architecture (values from its config.json), random weights.
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=0,
)


def real_smollm2() -> Path:
    """SmolLM2-135M-Instruct as transformers saves it (fetched once: tests/real_model.py)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.real_model import smollm2_hf

    return smollm2_hf()


def random_checkpoint(name: str, config: dict, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Save (once) a random-weight LlamaForCausalLM with `config` in Hugging Face format."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = CACHE / name
    if (out / "model.safetensors").is_file():
        return out
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).to(dtype)
    model.save_pretrained(out)
    return out


def machine() -> dict:
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def save_results(name: str, results: dict) -> Path:
    out = Path(__file__).resolve().parent / "results" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return out
