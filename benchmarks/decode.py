"""Decode speed: expresslane against transformers `generate`, same weights, same run.

Random weights of the SmolLM2-135M architecture (bf16 checkpoint), prompt 128 tokens, 64 new
tokens (EOS ignored). Reports batch-1 decode tokens/s (first token excluded: prefill is timed
separately), batch-16/32/64/128 throughput (all generated tokens / wall time, prefill
included), and prompt throughput: prompt tokens / wall time of a one-token generate, at 1x2048
and 16x512 prompt tokens (`--prefill`).

    python benchmarks/decode.py [--batches 1,16,32,64,128] [--prefill 1x2048,16x512]
                                [--rounds 5] [--skip-hf] [--dtype auto] [--quantization nvfp4]
                                [--temperature 0] [--top-p 1] [--model smollm2]
                                [--device auto] [--kv-cache-gb 1] [--hf-dtypes bfloat16,float32]
                                [--tensor-parallel-size N]

`--model smollm2` runs the real SmolLM2-135M-Instruct (the directory transformers saves from its
GGUF, bf16: tests/real_model.py) instead of random weights of its architecture; any other value
is a model directory.

Batch-1 decode is measured in `--rounds` rounds that alternate the engines (models loaded
once), and the ratios are medians of per-round ratios: this machine's memory bandwidth drifts
by tens of percent within minutes, which would otherwise favour whichever engine ran later.

transformers runs in the checkpoint's dtype (bf16) and, because bf16 matmuls are slow on CPUs
without AVX-512/AMX, also in float32; both are reported. expresslane uses dtype="auto" unless
`--dtype` names another, and the bf16 weights unless `--quantization` names an FP4 format; it
decodes greedily unless `--temperature` is set (with `--top-p`, nucleus sampling; transformers
always decodes greedily).

`--tensor-parallel-size N` measures expresslane at size 1 and then at size N, in that order
(rank 0 takes its share of the cores and threads while its group lives, so the two cannot
alternate), on `SMOLLM2_SPLIT` (SmolLM2-135M's weight shapes with heads that split) unless
`--model` names another; each reports its own batch-1 median over `--rounds`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import (
    SMOLLM2_135M,
    SMOLLM2_SPLIT,
    machine,
    model_vocab,
    random_checkpoint,
    real_smollm2,
    save_results,
)

PROMPT, NEW = 128, 64
VOCAB = SMOLLM2_135M["vocab_size"]  # the model's (main)


def prompts(batch: int, length: int = PROMPT) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch * 10007 + length)
    return torch.randint(1, VOCAB, (batch, length), generator=g).tolist()


def model_path(name: str | None, split: bool = False):
    if name is None and split:
        return random_checkpoint("smollm2-135m-split", SMOLLM2_SPLIT)
    if name is None:
        return random_checkpoint("smollm2-135m", SMOLLM2_135M)
    if name == "smollm2":
        return real_smollm2()
    return name


def bench_expresslane(path, batches: list[int], prefill: list[tuple[int, int]], args, tp: int = 1):
    """(figures, batch-1 sampler, close) of expresslane at tensor-parallel size `tp`."""
    from expresslane import LLM, SamplingParams

    longest = max([PROMPT + NEW, *(n + 1 for _, n in prefill)])
    llm = LLM(
        str(path),
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        kv_cache_memory_gb=args.kv_cache_gb,
        max_model_len=longest,
        max_batch=max(batches),
        max_num_batched_tokens=2048,
        tensor_parallel_size=tp,
    )
    sp = SamplingParams(
        max_tokens=NEW, temperature=args.temperature, top_p=args.top_p, ignore_eos=True, seed=0
    )
    llm.generate(prompts(2), sp)  # warm-up
    out = {"dtype": str(llm.engine.dtype).removeprefix("torch.")}
    for b in batches:
        t = time.perf_counter()
        res = llm.generate(prompts(b), sp)
        wall = time.perf_counter() - t
        row = {"throughput": b * NEW / wall}
        if b == 1:
            m = res[0].metrics
            row["decode_tok_s"] = m["decode_tokens_per_s"]
            row["ttft_s"] = m["ttft"]
        out[b] = row
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for b, n in prefill:  # fresh prompts each time: nothing comes from the prefix cache
        t = time.perf_counter()
        llm.generate(prompts(b, n), one)
        out[f"prefill {b}x{n}"] = b * n / (time.perf_counter() - t)

    def batch1() -> float:
        return llm.generate(prompts(1), sp)[0].metrics["decode_tokens_per_s"]

    return out, batch1, llm.close


def bench_hf(
    path, batches: list[int], prefill: list[tuple[int, int]], dtype: torch.dtype, device: str
):
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    class Stamps(LogitsProcessor):
        """Records when each new token's logits are ready (one call per generated token)."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()

    def run(batch: int, n: int, length: int = PROMPT) -> tuple[float, list[float], float]:
        ids = torch.tensor(prompts(batch, length), device=device)
        stamps = Stamps()
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([stamps]),
            )
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t, stamps.times, t

    run(1, 4)  # warm-up
    out = {"dtype": str(dtype).removeprefix("torch.")}
    for b in batches:
        wall, times, start = run(b, NEW)
        row = {"throughput": b * NEW / wall}
        if b == 1:
            row["decode_tok_s"] = (len(times) - 1) / (times[-1] - times[0])
            row["ttft_s"] = times[0] - start
        out[b] = row
    for b, n in prefill:
        out[f"prefill {b}x{n}"] = b * n / run(b, 1, n)[0]

    def batch1() -> float:
        _, times, _ = run(1, NEW)
        return (len(times) - 1) / (times[-1] - times[0])

    return out, batch1


def bench_tensor_parallel(path, batches, prefill, args) -> dict:
    """expresslane at `--tensor-parallel-size`, its batch-1 rounds run before it closes."""
    out, batch1, close = bench_expresslane(path, batches, prefill, args, args.tensor_parallel_size)
    try:
        if 1 in batches:
            rounds = [batch1() for _ in range(args.rounds)]
            out["batch1_rounds"] = rounds
            out[1]["decode_tok_s"] = statistics.median(rounds)
    finally:
        close()
    return out


HF_NAMES = {"bfloat16": "hf_bf16", "float32": "hf_fp32"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16,32,64,128")
    ap.add_argument("--prefill", default="1x2048,16x512", help="prompt shapes, BATCHxTOKENS")
    ap.add_argument("--rounds", type=int, default=5, help="alternating batch-1 rounds")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--dtype", default="auto", help="expresslane's dtype (auto, bfloat16, ...)")
    ap.add_argument("--temperature", type=float, default=0.0, help="expresslane's sampling")
    ap.add_argument("--top-p", type=float, default=1.0, help="expresslane's sampling")
    ap.add_argument("--quantization", default=None, help="expresslane's weights: nvfp4, mxfp4")
    ap.add_argument("--model", default=None, help="smollm2 (the real model) or a directory")
    ap.add_argument("--device", default="auto", help="both engines' (auto: cuda if there is one)")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0, help="expresslane's KV cache")
    ap.add_argument("--hf-dtypes", default="bfloat16,float32", help="transformers' dtypes")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="also at this size")
    args = ap.parse_args()
    global VOCAB
    batches = [int(b) for b in args.batches.split(",")]
    prefill = [
        tuple(int(v) for v in shape.split("x")) for shape in args.prefill.split(",") if shape
    ]
    tp = args.tensor_parallel_size
    path = model_path(args.model, split=tp > 1)
    VOCAB = model_vocab(path)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {"machine": machine(), "model": str(path), "prompt": PROMPT, "new_tokens": NEW}
    results["expresslane"], sampler, _ = bench_expresslane(path, batches, prefill, args)
    samplers = {"expresslane": sampler}
    if tp > 1:
        results[f"expresslane_tp{tp}"] = bench_tensor_parallel(path, batches, prefill, args)
    if not args.skip_hf:
        for dtype in args.hf_dtypes.split(","):
            name = HF_NAMES[dtype]
            results[name], samplers[name] = bench_hf(
                path, batches, prefill, getattr(torch, dtype), device
            )
    if 1 in batches:
        rounds = [{name: fn() for name, fn in samplers.items()} for _ in range(args.rounds)]
        results["batch1_rounds"] = rounds
        for name in samplers:
            results[name][1]["decode_tok_s"] = statistics.median(r[name] for r in rounds)
        for name in samplers:
            if name.startswith("hf_"):
                ratios = [r["expresslane"] / r[name] for r in rounds]
                results[f"ratio_vs_{name}"] = statistics.median(ratios)
                print(f"batch-1 decode ratio vs {name} per round: {[round(x, 2) for x in ratios]}")
    print(f"machine: {results['machine']}")
    shapes = [f"prefill {b}x{n}" for b, n in prefill]
    print(
        "| engine | dtype | batch-1 decode tok/s | "
        + " | ".join([f"batch {b} tok/s" for b in batches] + [f"{s} tok/s" for s in shapes])
        + " |"
    )
    print("|---|---|---|" + "---|" * (len(batches) + len(shapes)))
    for name in ("expresslane", f"expresslane_tp{tp}", "hf_bf16", "hf_fp32"):
        r = results.get(name)
        if not r:
            continue
        dec = r.get(1, {}).get("decode_tok_s")
        cells = [f"{r[b]['throughput']:.0f}" if b in r else "—" for b in batches]
        cells += [f"{r[s]:.0f}" for s in shapes]
        print(f"| {name} | {r['dtype']} | {dec or float('nan'):.1f} | " + " | ".join(cells) + " |")
    for name in ("hf_bf16", "hf_fp32"):
        if f"ratio_vs_{name}" in results:
            print(f"batch-1 decode ratio vs {name} (median): {results[f'ratio_vs_{name}']:.2f}x")
    print(f"saved {save_results('decode', results)}")


if __name__ == "__main__":
    main()
