"""Every step through the native kernels against the Python layers (demo target, SmolLM2).

With AVX-512 BF16 every CPU step (prompt chunks and large batches included) runs the native
step (kernels/layer_stack_cpu.cpp) on the bf16 dot-product linears, so each row is computed alike
whatever else is in the step. This measures what that costs or saves, side by side in one
process:

- linears: the dot-product kernel against oneDNN's bf16 matmul (float32 activations cast to
  bf16, output cast back: the Python layers' larger batches before the native step stack),
  the model's four layer shapes at 1-512 rows;
- prompts: time to first token of one prompt of 128-2000 random tokens, every step native
  against the Python layers (SDPA attention, torch norms) with the same linears;
- batches: throughput of 128-token prompts and 64 new tokens each at batch 16, 32 and 64,
  both ways (up to 16 decode rows run the native step either way).

    python benchmarks/native_steps.py [--model demo|smollm2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time

import torch
from common import SMOLLM2_135M, machine, random_checkpoint, save_results

from expresslane import LLM, SamplingParams
from expresslane.kernels import cpu_kernels


def best_seconds(fn, repeats: int, inner: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return min(times)


def layer_shapes(llm: LLM) -> dict[str, tuple[int, int]]:
    """(N, K) of the first layer's linears, from their packed weights [N/16, K/2, 32]."""
    layer = llm.engine.model.layers[0]
    shapes = {}
    for name in ("qkv", "o", "gate_up", "down"):
        packed = getattr(layer, name).kernel_weights()[0]
        shapes[name] = (packed.shape[0] * 16, packed.shape[1] * 2)
    return shapes


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=g).tolist()


def linears(shapes: dict[str, tuple[int, int]], repeats: int) -> dict:
    kernels = cpu_kernels()
    g = torch.Generator().manual_seed(0)
    out = {}
    for rows in (1, 16, 32, 64, 128, 512):
        row = {}
        for name, (n, k) in shapes.items():
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


@contextlib.contextmanager
def steps_through(llm: LLM, mode: str):
    """Every step through the native kernels ("native") or the Python layers ("python")."""
    model = llm.engine.model
    saved = model.plan
    model.plan = dataclasses.replace(saved, every_step=mode == "native")
    try:
        yield
    finally:
        model.plan = saved


def prompts_ttft(llm: LLM, repeats: int) -> dict:
    vocab = llm.engine.model.cfg.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0)
    out, seed = {}, 0
    for length in (128, 512, 1024, 2000):
        times: dict[str, list[float]] = {"native": [], "python": []}
        for _ in range(repeats):
            for mode in times:  # new random tokens each time: no prefix-cache hits
                seed += 1
                prompt = random_prompts(1, length, vocab, seed)
                with steps_through(llm, mode):
                    start = time.perf_counter()
                    llm.generate(prompt, params)
                    times[mode].append(time.perf_counter() - start)
        row = {m: round(min(t) * 1e3, 2) for m, t in times.items()}
        row["native_vs_python"] = round(row["native"] / row["python"], 2)
        out[length] = row
        print(f"prompt of {length} tokens, ms to first token:", row, flush=True)
    return out


def batches(path: str | None, repeats: int) -> dict:
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    out = {}
    for batch in (16, 32, 64):
        llm = LLM(path, max_batch=batch, max_model_len=1024, max_num_batched_tokens=2048)
        prompts = random_prompts(batch, 128, llm.engine.model.cfg.vocab_size, batch)
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0))
        speeds: dict[str, list[float]] = {"native": [], "python": []}
        for _ in range(repeats):
            for mode in speeds:
                with steps_through(llm, mode):
                    start = time.perf_counter()
                    outs = llm.generate(prompts, params)
                    seconds = time.perf_counter() - start
                speeds[mode].append(sum(len(o.token_ids) for o in outs) / seconds)
        row = {f"{m}_tok_s": round(max(s), 1) for m, s in speeds.items()}
        row["native_vs_python"] = round(max(speeds["native"]) / max(speeds["python"]), 2)
        out[batch] = row
        print(f"batch {batch}, throughput:", row, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["demo", "smollm2"], default="demo")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    path = None if args.model == "demo" else str(random_checkpoint("smollm2-135m", SMOLLM2_135M))
    llm = LLM(path, max_batch=8, max_model_len=2048)
    if not llm.engine.model.plan.every_step:
        raise SystemExit("every step runs the native kernels only with AVX-512 BF16")
    results = {"machine": machine(), "args": vars(args)}
    results["linears"] = linears(layer_shapes(llm), args.repeats)
    results["prompts"] = prompts_ttft(llm, args.repeats)
    del llm
    results["batches"] = batches(path, args.repeats)
    print("saved", save_results(f"native_steps_{args.model}", results))


if __name__ == "__main__":
    main()
