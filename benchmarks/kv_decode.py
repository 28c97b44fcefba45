"""Batch-1 decode speed by KV cache format: plain float32 KV, bf16, FP8 and FP4 KV in the
native decode step, and FP8 KV through the Python layers (the path before the native step read
compressed KV), same run, modes interleaved over rounds (median reported).

Random weights of the SmolLM2-135M architecture (bf16 checkpoint), prompt `--prompt` tokens
(128; a long one shows the KV bytes each step reads), 64 new tokens.

    python benchmarks/kv_decode.py [--rounds 3] [--prompt 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
from common import SMOLLM2_135M, machine, random_checkpoint, save_results

from expresslane import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    args = ap.parse_args()
    path = str(random_checkpoint("smollm2-135m", SMOLLM2_135M))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, SMOLLM2_135M["vocab_size"], (args.prompt,), generator=g).tolist()
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    opts = dict(max_model_len=max(1024, args.prompt + 128), max_num_batched_tokens=2048)
    llms = {
        "plain": LLM(path, **opts),
        "bf16_native": LLM(path, kv_cache_dtype="bfloat16", **opts),
        "fp8_native": LLM(path, kv_cache_dtype="fp8", **opts),
        "fp4_native": LLM(path, kv_cache_dtype="fp4", **opts),
        "fp8_python_layers": LLM(path, kv_cache_dtype="fp8", **opts),
    }
    model = llms["fp8_python_layers"].engine.model
    model.plan = dataclasses.replace(model.plan, stack=False)
    for llm in llms.values():
        llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    speeds: dict[str, list[float]] = {name: [] for name in llms}
    tokens = {}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            out = llm.generate(prompt, params)[0]
            speeds[name].append(out.metrics["decode_tokens_per_s"])
            tokens[name] = out.token_ids
    results = {"machine": machine(), "rounds": speeds}
    for name, v in speeds.items():
        results[name] = round(statistics.median(v), 1)
        print(f"{name}: {results[name]} tok/s (rounds {[round(x, 1) for x in v]})")
    same = tokens["fp8_native"] == tokens["fp8_python_layers"]
    results["fp8_same_tokens_both_paths"] = same
    print("fp8 native and Python layers give the same tokens:", same)
    print("saved", save_results("kv_decode", results))


if __name__ == "__main__":
    main()
