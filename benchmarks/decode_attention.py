"""Decode attention alone, by KV store: `kernels.decode_attention` over every store the native
step reads (float32, bf16, FP8, FP4 rows), SmolLM2-135M's heads (9 query, 3 KV of dim 64),
one decode row per sequence. Each layer has its own cache, and there are as many of them as it
takes to exceed 96 MB (more than the L3 of these machines: rows come from DRAM, as they do
between a step's weights); sequences hold consecutive slots, as a fresh cache gives them.
Reports ms per 30 layers (SmolLM2's count) and the GB/s of KV rows read, median of repeats,
stores interleaved within each repeat.

    python benchmarks/decode_attention.py [--contexts 1024,4096] [--batch 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from common import machine, save_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from expresslane.kernels import cpu_kernels  # noqa: E402
from expresslane.models.kv_store import STORES  # noqa: E402

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30


def layer_caches(store_cls, batch: int, context: int, per_seq: int) -> list:
    """(native tensors, kind) of enough random caches to exceed 96 MB."""
    row_bytes = store_cls.bytes_per_token(KV_HEADS, DIM, torch.float32) * context * batch
    caches = []
    for _ in range(max(LAYERS, int(96e6 / row_bytes) + 1)):
        store = store_cls(KV_HEADS, batch * per_seq, DIM, torch.float32, "cpu")
        n = batch * per_seq
        store.write(torch.randn(n, KV_HEADS, DIM), torch.randn(n, KV_HEADS, DIM), torch.arange(n))
        caches.append((store.native(), int(store_cls.NATIVE_KIND)))
    return caches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    kernels = cpu_kernels()
    results = {"machine": machine(), "batch": args.batch}
    for context in (int(c) for c in args.contexts.split(",")):
        per_seq = (context // 16 + 2) * 16
        slots = torch.cat([b * per_seq + torch.arange(context) for b in range(args.batch)])
        starts = torch.full((args.batch,), context - 1)
        q = torch.randn(args.batch, HEADS, DIM)
        caches = {
            name: layer_caches(cls, args.batch, context, per_seq) for name, cls in STORES.items()
        }
        times: dict[str, list[float]] = {name: [] for name in STORES}
        for _ in range(args.repeats + 1):  # the first round warms up
            for name, layers in caches.items():
                start = time.perf_counter()
                for kv, kind in layers:
                    kernels.decode_attention(q, kv, kind, slots, context, 1, starts)
                times[name].append((time.perf_counter() - start) / len(layers) * LAYERS)
        for name, cls in STORES.items():
            t = statistics.median(times[name][1:])
            read = cls.bytes_per_token(KV_HEADS, DIM, torch.float32) * context * args.batch
            results[f"{name}@{context}"] = {
                "ms": round(t * 1e3, 3),
                "gb_s": round(read * LAYERS / t / 1e9, 1),
            }
            print(
                f"context {context} {name:9s}: {t * 1e3:7.3f} ms per {LAYERS} layers, "
                f"{read * LAYERS / t / 1e9:5.1f} GB/s of KV rows"
            )
    print(f"saved {save_results('decode_attention', results)}")


if __name__ == "__main__":
    main()
