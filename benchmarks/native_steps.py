"""Every step through the native kernels against the Python layers, on the demo target.

With AVX-512 BF16 every CPU step (prompt chunks and large batches included) runs the native
step (kernels/decode_cpu.cpp) on the bf16 dot-product linears, so each row is computed alike
whatever else is in the step. This measures what that costs or saves, side by side in one
process:

- linears: the dot-product kernel against oneDNN's bf16 matmul (float32 activations cast to
  bf16, output cast back: the Python layers' larger batches before session 15), the demo
  target's five layer shapes at 1-512 rows;
- prompts: time to first token of one prompt of 128-2000 tokens, every step native against
  the Python layers (SDPA attention, torch norms) with the same linears;
- batches: decode throughput at batch 16 and 32, both ways.

    python benchmarks/native_steps.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import machine, save_results
from spec import workloads

from expresslane import LLM, SamplingParams
from expresslane.kernels import cpu_kernels

SHAPES = {"qkv": (640, 384), "o": (384, 384), "gate_up": (2304, 384), "down": (384, 1152)}


def best_seconds(fn, repeats: int, inner: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return min(times)


def linears(repeats: int) -> dict:
    kernels = cpu_kernels()
    g = torch.Generator().manual_seed(0)
    out = {}
    for rows in (1, 16, 32, 64, 128, 512):
        row = {}
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, generator=g).bfloat16()
            x = torch.randn(rows, k, generator=g)
            packed = kernels.pack_bf16_dot(w)
            onednn = torch.ops.mkldnn._reorder_linear_weight(w, 1)

            def dot_kernel(x=x, packed=packed):
                return kernels.bf16_dot_linear(x, packed, None)

            def onednn_bf16(x=x, onednn=onednn):
                bf16 = x.bfloat16()
                return torch.ops.mkldnn._linear_pointwise(
                    bf16, onednn, None, "none", [None], ""
                ).float()

            dot = best_seconds(dot_kernel, repeats)
            ref = best_seconds(onednn_bf16, repeats)
            row[name] = {"dot_us": round(dot * 1e6, 1), "onednn_us": round(ref * 1e6, 1)}
        total = sum(v["dot_us"] for v in row.values()) / sum(v["onednn_us"] for v in row.values())
        out[rows] = {**row, "dot_vs_onednn": round(total, 2)}
        print(f"linears, {rows} rows: dot / oneDNN time {total:.2f}", row, flush=True)
    return out


def with_native(llm: LLM, native: bool):
    model = llm.engine.model
    saved = model.native_all
    model.native_all = native
    return saved


def prompts_ttft(llm: LLM, repeats: int) -> dict:
    tok = llm.engine.tokenizer
    source = Path(__file__).resolve().parent.parent / "src" / "expresslane" / "engine"
    ids = tok.encode("".join(p.read_text() for p in sorted(source.glob("*.py"))), False)
    params = SamplingParams(max_tokens=1, temperature=0)
    out, offset = {}, 0
    for length in (128, 512, 1024, 2000):
        times: dict[str, list[float]] = {"native": [], "python": []}
        for _ in range(repeats):
            for mode in times:  # a fresh slice of text each time: no prefix-cache hits
                prompt = tok.decode(ids[offset : offset + length])
                offset += 97
                saved = with_native(llm, mode == "native")
                start = time.perf_counter()
                llm.generate(prompt, params)
                times[mode].append(time.perf_counter() - start)
                with_native(llm, saved)
        row = {m: round(min(t) * 1e3, 2) for m, t in times.items()}
        row["native_vs_python"] = round(row["native"] / row["python"], 2)
        out[length] = row
        print(f"prompt of {length} tokens, ms to first token:", row, flush=True)
    return out


def batches(repeats: int) -> dict:
    prompts = workloads(32)["complete"]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    out = {}
    for batch in (16, 32):
        llm = LLM(max_batch=batch, max_model_len=2048)
        llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0))
        speeds: dict[str, list[float]] = {"native": [], "python": []}
        for _ in range(repeats):
            for mode in speeds:
                saved = with_native(llm, mode == "native")
                start = time.perf_counter()
                outs = llm.generate(prompts[:batch], params)
                seconds = time.perf_counter() - start
                with_native(llm, saved)
                speeds[mode].append(sum(len(o.token_ids) for o in outs) / seconds)
        row = {f"{m}_tok_s": round(max(s), 1) for m, s in speeds.items()}
        row["native_vs_python"] = round(max(speeds["native"]) / max(speeds["python"]), 2)
        out[batch] = row
        print(f"batch {batch}, decode throughput:", row, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    llm = LLM(max_batch=8, max_model_len=2048)
    if not llm.engine.model.native_all:
        raise SystemExit("every step runs the native kernels only with AVX-512 BF16")
    results = {"machine": machine(), "args": vars(args)}
    results["linears"] = linears(args.repeats)
    results["prompts"] = prompts_ttft(llm, args.repeats)
    results["batches"] = batches(args.repeats)
    print("saved", save_results("native_steps", results))


if __name__ == "__main__":
    main()
