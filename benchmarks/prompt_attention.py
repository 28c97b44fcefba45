"""Prompt attention alone: the tiled kernel (float32 and bf16 products), the decode kernel it
replaced for prompt rows, and PyTorch's SDPA (float32 and bf16), on one causal prompt of T
tokens over a plain float32 cache: 8 query heads, 2 KV heads of dim 64 (GQA 4), all in one run.
Reports seconds and GFLOP/s (4 T^2/2 H D flops) and each kernel's largest difference from
float32 SDPA.

    python benchmarks/prompt_attention.py [--lengths 2048,8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import machine, save_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from expresslane.kernels import cpu_kernels  # noqa: E402

HEADS, KV_HEADS, DIM = 8, 2, 64


def timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    fn()  # warm up
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def kernels_at(T: int, repeats: int) -> dict:
    k = cpu_kernels()
    g = torch.Generator().manual_seed(T)
    q = torch.randn(T, HEADS, DIM, generator=g)
    cache = torch.randn(2, KV_HEADS, T, DIM, generator=g)
    slots, lens, starts = torch.arange(T), torch.tensor([T]), torch.tensor([0])
    qs, ks, vs = q.transpose(0, 1)[None], cache[0][None], cache[1][None]

    def sdpa(dtype):
        def run():
            o = F.scaled_dot_product_attention(
                qs.to(dtype), ks.to(dtype), vs.to(dtype), is_causal=True, enable_gqa=True
            )
            return o[0].transpose(0, 1).reshape(T, -1).float()

        return run

    runs = {
        "tiled float32": lambda: k.prompt_attention(q, [cache], 0, slots, T, lens, starts, False),
        "tiled bf16": lambda: k.prompt_attention(q, [cache], 0, slots, T, lens, starts, True),
        "decode kernel": lambda: k.decode_attention(q, [cache], 0, slots, T, T, starts),
        "sdpa float32": sdpa(torch.float32),
        "sdpa bf16": sdpa(torch.bfloat16),
    }
    if not k.bf16_dot_available():
        del runs["tiled bf16"]
    flops = 4 * T * T / 2 * HEADS * DIM
    out, reference = {}, None
    for name, fn in runs.items():
        seconds, y = timed(fn, repeats)
        if reference is None and name == "sdpa float32":
            reference = y
        out[name] = {
            "seconds": round(seconds, 4),
            "gflops": round(flops / seconds / 1e9, 1),
            "y": y,
        }
    for row in out.values():
        row["max_diff"] = float((row.pop("y") - reference).abs().max())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="2048,8192", help="prompt lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    results = {"machine": machine(), "heads": HEADS, "kv_heads": KV_HEADS, "dim": DIM}
    for T in (int(t) for t in args.lengths.split(",")):
        results[str(T)] = kernels_at(T, args.repeats)
        for name, row in results[str(T)].items():
            print(
                f"T={T:6d} {name:14s} {row['seconds']:8.4f} s {row['gflops']:7.1f} GFLOP/s "
                f"max diff {row['max_diff']:.1e}"
            )
    print("saved", save_results("prompt_attention", results))


if __name__ == "__main__":
    main()
