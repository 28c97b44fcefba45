"""Long prompts: the time to first token of a 32k-token prompt, and a 32k-token request within
a fixed KV memory budget, with and without KV compression.

1. TTFT. Random weights of an 8-layer Llama (hidden 512, 8 heads and 2 KV heads of dim 64,
   FFN 1536), saved in bf16; prompt 32,768 tokens, one new token. expresslane (dtype auto:
   bf16 weights, float32 compute; prompt chunks of 2,048 tokens) with plain and fp8 KV, against
   one forward pass of transformers (SDPA) in bf16 and in float32 over the same prompt, all
   in this run.
2. Budget. The test suite's Llama (2 layers, hidden 64, 2 KV heads of dim 16: a 32k prefill
   takes seconds), prompt 32,768 tokens, 4 new tokens, KV budget 20 MB: KV bytes per token,
   the KV memory the request held, how many tokens the budget holds, and the wall time.

    python benchmarks/long_context.py [--prompt 32768] [--skip-hf] [--skip-budget]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from common import CACHE, machine, save_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from expresslane import LLM, SamplingParams  # noqa: E402
from tests.conftest import bf16_copy, make_checkpoint  # noqa: E402

NEW, BUDGET_GB = 4, 0.02
TTFT_MODEL = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
)


def checkpoint(name: str, max_positions: int, **config) -> Path:
    """A random-weight Llama with the test suite's tokenizer, made once; its bf16 copy if
    `name` ends in -bf16."""
    root = CACHE / f"long-context-{name}"
    ckpt = root / "llama"
    if not (ckpt / "model.safetensors").is_file():
        root.mkdir(parents=True, exist_ok=True)
        make_checkpoint(root, "llama", max_position_embeddings=max_positions, **config)
    if name.endswith("-bf16"):
        out = root / "bf16"
        if not (out / "model.safetensors").is_file():
            bf16_copy(ckpt, out)
            for f in ckpt.glob("tokenizer*"):
                (out / f.name).write_bytes(f.read_bytes())
        return out
    return ckpt


def expresslane_ttft(ckpt: Path, prompt: list[int], kv: str) -> dict:
    llm = LLM(
        str(ckpt),
        kv_cache_dtype=kv,
        kv_cache_memory_gb=0.6,
        max_model_len=len(prompt) + 8,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        calibrate=False,
    )
    engine = llm.engine
    start = time.perf_counter()
    req = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while not req.output_token_ids:
        engine.step()
    ttft = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return {"seconds": round(ttft, 2), "plan": engine.model.plan.describe()}


def transformers_ttft(ckpt: Path, prompt: list[int], dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, attn_implementation="sdpa")
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        start = time.perf_counter()
        logits = model(ids, logits_to_keep=1).logits
        ttft = time.perf_counter() - start
    assert logits.shape[1] == 1
    return {"seconds": round(ttft, 2)}


def ttft(prompt_tokens: int, skip_hf: bool) -> dict:
    ckpt = checkpoint("ttft-bf16", prompt_tokens + 64, **TTFT_MODEL)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 512, (prompt_tokens,), generator=g).tolist()
    runs = {}
    for kv in ("auto", "fp8"):
        runs[f"expresslane {kv} KV"] = row = expresslane_ttft(ckpt, prompt, kv)
        print(f"expresslane {kv} KV", row, flush=True)
    if not skip_hf:
        for dtype in (torch.bfloat16, torch.float32):
            name = f"transformers {str(dtype).removeprefix('torch.')} SDPA"
            runs[name] = row = transformers_ttft(ckpt, prompt, dtype)
            print(name, row, flush=True)
    return runs


def budget(prompt_tokens: int) -> dict:
    ckpt = checkpoint("budget", 40_000)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 512, (prompt_tokens,), generator=g).tolist()
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    runs = {}
    for kv in ("auto", "fp8", "fp4"):
        llm = LLM(
            str(ckpt),
            dtype="float32",  # bf16 matmuls are slow on AVX2-only CPUs
            kv_cache_dtype=kv,
            kv_cache_memory_gb=BUDGET_GB,
            max_model_len=prompt_tokens + NEW,
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
        runs[kv] = row = {
            "kv_bytes_per_token": engine.kv_bytes_per_token,
            "vs_bf16_kv": round(engine.kv_bytes_per_token / bf16_per_token, 3),
            "kv_mb_used": round(peak * block_bytes / 1e6, 2),
            "budget_holds_tokens": engine.kv.num_blocks * engine.kv.block_size,
            "seconds": round(wall, 1),
            "compute_dtype": str(engine.dtype).removeprefix("torch."),
        }
        print(kv, row, flush=True)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=32_768, help="prompt tokens")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers baseline")
    ap.add_argument("--skip-budget", action="store_true", help="the TTFT part only")
    args = ap.parse_args()
    results = {"machine": machine(), "prompt_tokens": args.prompt}
    results["ttft"] = ttft(args.prompt, args.skip_hf)
    if not args.skip_budget:
        results["budget_gb"] = BUDGET_GB
        results["runs"] = budget(args.prompt)
    print("saved", save_results("long_context", results))


if __name__ == "__main__":
    main()
