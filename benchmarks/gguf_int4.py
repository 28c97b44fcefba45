"""A GGUF's 4-bit blocks kept 4-bit against widened to bf16: decode speed on the real model.

SmolLM2-135M-Instruct's Q4_1 GGUF (tests/real_model.py) loaded twice in one process: as
`--model FILE.gguf` loads it (the Q4_1 linears kept in their blocks, kernels/int4_cpu.cpp) and
with `EXPRESSLANE_GGUF_4BIT=0` (every tensor widened to bf16, the bf16 kernels). Prompts of 128
random tokens, 64 new tokens, EOS ignored. Batch 1: decode tokens/s (first token excluded) and
time to first token; batch 16 (all prompts prefilled in one step, then decoded together): the
requests' decode tokens/s summed. Rounds alternate the two models (loaded once, the order
flipped every round); the ratios are medians of per-round ratios, since this machine's speed
drifts by tens of percent within minutes (and more where other jobs share its cores: the
best round of each is printed too; `--threads 1` keeps threads from waiting on each other
there).

    python benchmarks/gguf_int4.py [--rounds 10] [--batches 1,16] [--threads N]

(Not benchmarks/gguf.py: run as a script, that name would shadow the `gguf` package.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
from common import machine, save_results

from expresslane import LLM, SamplingParams
from expresslane.gguf_file import KEEP_4BIT_ENV

PROMPT, NEW = 128, 64
MODES = {"4-bit": "1", "bf16": "0"}  # EXPRESSLANE_GGUF_4BIT


def gguf_file() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.real_model import smollm2_gguf

    return smollm2_gguf()


def load(path: Path, keep: str, max_batch: int) -> LLM:
    os.environ[KEEP_4BIT_ENV] = keep
    try:
        return LLM(
            str(path),
            max_model_len=PROMPT + NEW,
            max_batch=max_batch,
            max_num_batched_tokens=max_batch * PROMPT,
            enable_prefix_caching=False,
        )
    finally:
        del os.environ[KEEP_4BIT_ENV]


def linear_mb(llm: LLM) -> float:
    """Megabytes the layers' linear weights hold: 4-bit blocks, or what the bf16 kernel reads."""
    total = 0
    for m in llm.engine.model.layer_linears():
        held = [*m.buffers(), *m.parameters(), getattr(m, "_half", None), m.matrix]
        total += sum(t.nbytes for t in held if t is not None and t.dim() >= 2)
    return total / 1e6


def prompts(batch: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 49152, (batch, PROMPT), generator=g).tolist()


def measure(llm: LLM, batch: int, seed: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts(batch, seed), params)
    rates = [o.metrics["decode_tokens_per_s"] for o in outs]
    return {
        "decode_tok_s": sum(rates),
        "ttft_ms": 1000 * statistics.median(o.metrics["ttft"] for o in outs),
    }


def summarize(samples: dict, batches: list[int], names: list[str]) -> list[dict]:
    rows = []
    for b in batches:
        for name in names:
            runs, base = samples[name, b], samples["bf16", b]
            ratios = [s["decode_tok_s"] / t["decode_tok_s"] for s, t in zip(runs, base)]
            rows.append(
                {
                    "batch": b,
                    "model": name,
                    "decode_tok_s": round(statistics.median(s["decode_tok_s"] for s in runs), 1),
                    "best_decode_tok_s": round(max(s["decode_tok_s"] for s in runs), 1),
                    "ttft_ms": round(statistics.median(s["ttft_ms"] for s in runs), 1),
                    "decode_vs_bf16": round(statistics.median(ratios), 2),
                    "ratio_per_round": [round(x, 2) for x in ratios],
                }
            )
    return rows


def print_table(rows: list[dict]) -> None:
    head = ("batch", "model", "decode tok/s", "best", "ttft ms", "vs bf16", "per round")
    print("\n{:>5} {:>6} {:>13} {:>7} {:>8} {:>8}  {}".format(*head))
    for r in rows:
        print(
            f"{r['batch']:>5} {r['model']:>6} {r['decode_tok_s']:>13.1f} "
            f"{r['best_decode_tok_s']:>7.1f} {r['ttft_ms']:>8.1f} {r['decode_vs_bf16']:>7.2f}x"
            f"  {r['ratio_per_round']}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: its own)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    path = gguf_file()
    llms = {name: load(path, keep, max(batches)) for name, keep in MODES.items()}
    for name, llm in llms.items():
        print(f"{name}: {llm.engine.model.plan.describe()}", flush=True)
        measure(llm, 2, seed=0)  # warm-up
    samples = {(name, b): [] for name in llms for b in batches}
    for r in range(args.rounds):
        for b in batches:
            order = list(llms) if r % 2 == 0 else list(llms)[::-1]
            for name in order:  # the same prompts for both, new ones each round
                samples[name, b].append(measure(llms[name], b, seed=1000 * r + b))
    rows = summarize(samples, batches, list(llms))
    print_table(rows)
    weights = {name: round(linear_mb(llm), 1) for name, llm in llms.items()}
    print("layer linear weights (MB):", weights)
    results = {"machine": machine(), "args": vars(args), "gguf": path.name, "rows": rows}
    print("saved", save_results("gguf_int4", {**results, "linear_weights_mb": weights}))


if __name__ == "__main__":
    main()
