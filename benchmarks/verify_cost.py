"""What a speculative verification costs against a plain decode step, on the demo target.

Speculation pays when scoring k+1 tokens of a sequence costs about as much as scoring one
(a memory-bound step reads the weights once either way). This times the native decode step
(kernels/layer_stack_cpu.cpp: every layer, then the output head) for one sequence with 1 and
with k+1 query rows, at several context lengths, and reports each cost as a multiple of the
1-row step. A verification of k guesses that are accepted at rate a yields
1 + a + ... + a^k tokens; it pays where that exceeds the multiple (plus the proposal's cost).

    python benchmarks/verify_cost.py [--k 4] [--contexts 64,512,1024] [--repeats 300]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import machine, save_results

from expresslane import LLM


def time_rows(model, rows: int, ctx: int, repeats: int) -> tuple[float, float]:
    """Seconds of (layers, output head) for `rows` new tokens after `ctx` cached ones."""
    stack = model.layer_stack
    length = ctx + rows
    slots = torch.arange(length, dtype=torch.long)  # any free slots will do for timing
    cos, sin = model.rotary.tables(torch.arange(ctx, length))
    x = torch.randn(rows, model.cfg.hidden_size)
    args = (
        cos,
        sin,
        slots[ctx:],
        slots,
        length,
        torch.tensor([rows]),
        torch.tensor([ctx]),
        torch.tensor([0]),
    )
    for _ in range(20):
        h = stack.forward(x, *args)
    start = time.perf_counter()
    for _ in range(repeats):
        h = stack.forward(x, *args)
    layers = (time.perf_counter() - start) / repeats
    start = time.perf_counter()
    for _ in range(repeats):
        stack.logits(h, None)
    return layers, (time.perf_counter() - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=4, help="guesses per verification")
    ap.add_argument("--contexts", default="64,512,1024")
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    model = LLM(max_batch=1, max_model_len=2048).engine.model
    if model.layer_stack is None or not model.plan.native_head:
        raise SystemExit("the C++ layer stack does not run on this machine")
    results: dict = {"machine": machine(), "args": vars(args), "rows": []}
    for ctx in [int(c) for c in args.contexts.split(",")]:
        one = time_rows(model, 1, ctx, args.repeats)
        many = time_rows(model, args.k + 1, ctx, args.repeats)
        row = {
            "context": ctx,
            "plain_ms": round(sum(one) * 1e3, 3),
            "verify_ms": round(sum(many) * 1e3, 3),
            "verify_vs_plain": round(sum(many) / sum(one), 2),
            "layers_ms": [round(one[0] * 1e3, 3), round(many[0] * 1e3, 3)],
            "head_ms": [round(one[1] * 1e3, 3), round(many[1] * 1e3, 3)],
        }
        results["rows"].append(row)
        print(row, flush=True)
    print("saved", save_results("verify_cost", results))


if __name__ == "__main__":
    main()
