"""A 32k-token request within a fixed KV memory budget, with and without KV compression.

Random weights of a Llama architecture (LlamaForCausalLM, 2 layers, hidden 64, 2 KV heads of
dim 16: the test suite's checkpoint, so a 32k-token prefill takes seconds on 2 CPU cores),
max_position_embeddings 40,000; prompt 32,768 tokens, 4 new tokens, KV budget 20 MB. Reports
KV bytes per token (plain KV is float32 here, the compute dtype; the bf16 ratio is given too),
the KV memory the request held, how many tokens the budget holds, and the wall time.

    python benchmarks/long_context.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from common import CACHE, machine, save_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from expresslane import LLM, SamplingParams  # noqa: E402
from tests.conftest import make_checkpoint  # noqa: E402

PROMPT, NEW, BUDGET_GB = 32_768, 4, 0.02


def main() -> None:
    root = CACHE / "long-context"
    ckpt = root / "llama"
    if not (ckpt / "model.safetensors").is_file():
        root.mkdir(parents=True, exist_ok=True)
        make_checkpoint(root, "llama", max_position_embeddings=40_000)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 512, (PROMPT,), generator=g).tolist()
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    results = {"machine": machine(), "prompt_tokens": PROMPT, "budget_gb": BUDGET_GB, "runs": {}}
    for kv in ("auto", "fp8", "fp4"):
        llm = LLM(
            str(ckpt),
            dtype="float32",  # bf16 matmuls are slow on AVX2-only CPUs
            kv_cache_dtype=kv,
            kv_cache_memory_gb=BUDGET_GB,
            max_model_len=PROMPT + NEW,
            max_num_batched_tokens=2048,
        )
        engine = llm.engine
        peak = 0
        start = time.perf_counter()
        engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, engine.kv.num_used_blocks)
        wall = time.perf_counter() - start
        block_bytes = engine.kv_bytes_per_token * engine.kv.block_size
        cfg = engine.model_config
        bf16_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
        row = {
            "kv_bytes_per_token": engine.kv_bytes_per_token,
            "vs_bf16_kv": round(engine.kv_bytes_per_token / bf16_per_token, 3),
            "kv_mb_used": round(peak * block_bytes / 1e6, 2),
            "budget_holds_tokens": engine.kv.num_blocks * engine.kv.block_size,
            "seconds": round(wall, 1),
            "compute_dtype": str(engine.dtype).removeprefix("torch."),
        }
        results["runs"][kv] = row
        print(kv, row, flush=True)
    print("saved", save_results("long_context", results))


if __name__ == "__main__":
    main()
