"""Helpers shared by the benchmark scripts: random-weight checkpoints of real architectures."""

from __future__ import annotations

import json
import os
import platform
import shutil
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

# SmolLM2-135M's weights' shapes with 12 attention heads of 48 and 4 KV heads in place of 9 of
# 64 and 3 (the same projection sizes, the same 3 query heads per KV head): a model that splits
# over 2 or 4 tensor-parallel ranks (benchmarks/decode.py --tensor-parallel-size).
SMOLLM2_SPLIT = {**SMOLLM2_135M, "num_attention_heads": 12, "num_key_value_heads": 4}

# Llama-3.2-1B's shape (0.99B parameters) with the demo model's 8192-token vocabulary, so that
# its tokenizer serves it (benchmarks/tiers.py talks text): the GPU check's model.
LLAMA_1B = dict(
    vocab_size=8192,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=2,
)
# The same family at a size a CPU runs in seconds (the GPU check's dry run).
TINY_LLAMA = {
    **LLAMA_1B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


PROMPT = 'def parse_config(path):\n    """Read the config file at *path*."""\n'


def stream_body(model: str, tier: str, max_tokens: int) -> dict:
    """A streamed completion of `PROMPT` on `tier`, each event's logprobs naming its tokens."""
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "stream": True,
        "logprobs": 0,
        "ignore_eos": True,
        "service_tier": tier,
    }


def event_tokens(data: str | bytes) -> int:
    """How many tokens one completion chunk (an SSE event's JSON) carries."""
    lp = json.loads(data)["choices"][0].get("logprobs") or {}
    return len(lp.get("tokens") or [])


def real_smollm2() -> Path:
    """SmolLM2-135M-Instruct as transformers saves it (fetched once: tests/real_model.py)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.real_model import smollm2_hf

    return smollm2_hf()


def random_checkpoint(
    name: str,
    config: dict,
    dtype: torch.dtype = torch.bfloat16,
    demo_tokenizer: bool = False,
    device: str = "cpu",
) -> Path:
    """Save (once) a random-weight LlamaForCausalLM with `config` in Hugging Face format,
    its weights drawn on `device`; with `demo_tokenizer`, the demo model's tokenizer beside it
    (its vocabulary: 8192)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = CACHE / name
    if not (out / "model.safetensors").is_file():
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**config)).to(dtype)
        model.save_pretrained(out)
    if demo_tokenizer:
        from expresslane.demo import demo_model_dir

        for f in TOKENIZER_FILES:
            shutil.copy(demo_model_dir() / f, out / f)
    return out


def model_vocab(path) -> int:
    return json.loads((Path(path) / "config.json").read_text())["vocab_size"]


def machine() -> dict:
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def process_cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process's (command line, CPU seconds so far), from /proc (Linux)."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        out[int(pid)] = (cmd, (int(stat[11]) + int(stat[12])) / tick)
    return out


def save_results(name: str, results: dict) -> Path:
    """benchmarks/results/NAME.json, or under $EXPRESSLANE_RESULTS_DIR (the GPU check's)."""
    folder = os.environ.get("EXPRESSLANE_RESULTS_DIR")
    out = Path(folder or Path(__file__).resolve().parent / "results") / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return out


def random_prompt_decode_speed(llm, vocab_size: int, prompt: int, new: int, low: int = 1) -> float:
    """Greedy decode tokens/s of one request: `prompt` random token ids (from `low`: above the
    special ids), `new` tokens made whatever the model says (EOS ignored), the first excluded."""
    from expresslane import SamplingParams

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(low, vocab_size, (prompt,), generator=g).tolist()
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    return llm.generate(ids, params)[0].metrics["decode_tokens_per_s"]
