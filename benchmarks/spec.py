"""Speculative decoding on the bundled demo model: decode speed with and without it, same run.

Workloads (held-out standard-library files, never trained on):
- edit: the prompt holds a function's source and then starts it again under a new name, the
  way an agent rewrites code it just read; the output largely repeats the source.
- complete: a held-out function's header (signature + docstring); the model writes the body.

Modes: plain decoding, n-gram prompt lookup, suffix lookup (n-gram's index plus a cache of
earlier outputs) and the bundled draft model, each at batch 1
(requests one at a time, modes interleaved per prompt so machine noise hits all alike; decode
tokens/s excludes the first token; `--batch1-rounds` passes over the prompts with the engines
kept loaded, as a server would, and the speedup is the median of the per-pass ratios) and at
batch 32 (total throughput, all requests at once; the modes' runs interleaved over
`--batch-rounds`, and the ratio is the median of the per-round ratios). Then n-gram
speculating at any batch size against plain at the `--mid-batches` sizes, the same way: where
speculation still pays here.
Greedy outputs are checked token-identical across modes.

    python benchmarks/spec.py [--prompts 24] [--max-tokens 128] [--k 12] [--batch1-rounds 3]
        [--batch-rounds 5] [--mid-batches 2,4,8] [--model smollm2]

`--model smollm2`: the real SmolLM2-135M-Instruct (tests/real_model.py), with the same code
given as chat requests (edit: "repeat this code, renamed"; complete: "complete this
function"), without the draft model (it has none).

`--sessions N` runs instead plain, n-gram and suffix on the ultrafast lane over N multi-turn
sessions per workload (benchmarks/spec_sessions.py: coding-agent sessions and plain chat), one
request at a time, and times the proposers' own work against the decode time:

    python benchmarks/spec.py --sessions 24 [--turns 4] [--workloads agent,chat]
        [--max-tokens 256] [--k 12] [--model smollm2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import spec_sessions
from common import machine, real_smollm2, save_results

# The repository root, for the `scripts` package: the workloads are the held-out functions
# that scripts/eval_demo_model.py picks. Run as `python benchmarks/spec.py`, sys.path[0] is
# benchmarks/ alone.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from expresslane import LLM, SamplingParams  # noqa: E402
from expresslane.engine.speculation.stats import SpecStats  # noqa: E402
from scripts.eval_demo_model import spec_workloads as workloads  # noqa: E402


def modes(k: int, draft: bool = True) -> dict[str, dict | None]:
    # max_batch None: speculate at any batch, to measure what adaptivity alone does at 32.
    out = {
        "plain": None,
        "ngram": {"method": "ngram", "num_tokens": k},
        "suffix": {"method": "suffix", "num_tokens": k},
    }
    return {**out, "draft": {"method": "draft", "num_tokens": k}} if draft else out


def chat_workloads(loads: dict[str, list[str]], model) -> dict[str, list[str]]:
    """The workloads as chat requests, rendered with the model's template."""
    from expresslane.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model)
    asks = {
        "edit": "Repeat this Python code, with the function renamed as its last line shows:\n\n",
        "complete": "Complete this Python function:\n\n",
    }
    return {
        name: [tok.apply_chat_template([{"role": "user", "content": asks[name] + p}]) for p in ps]
        for name, ps in loads.items()
    }


def run_batch1(llms: dict, prompts: list[str], params: SamplingParams) -> dict:
    tokens = {m: 0 for m in llms}
    seconds = {m: 0.0 for m in llms}
    outputs = {m: [] for m in llms}
    for prompt in prompts:
        order = list(llms)
        random.shuffle(order)
        for m in order:
            out = llms[m].generate(prompt, params)[0]
            tokens[m] += len(out.token_ids) - 1
            seconds[m] += out.metrics["e2e"] - out.metrics["ttft"]
            outputs[m].append(out.token_ids)
    return {m: (tokens[m] / seconds[m], outputs[m]) for m in llms}


def run_batch(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / wall, [o.token_ids for o in outs]


def spec_summary(llm: LLM) -> dict:
    s = llm.engine.speculation.stats
    return {
        "acceptance_rate": round(s.acceptance_rate, 3),
        "mean_accepted_tokens": round(s.mean_accepted_tokens, 2),
        "verify_steps": s.steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=12, help="most guesses per step")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument(
        "--batch1-rounds", type=int, default=3, help="passes over the prompts at batch 1"
    )
    ap.add_argument("--batch-rounds", type=int, default=5, help="interleaved runs per mode")
    ap.add_argument("--model", default=None, help="smollm2: the real model (chat, no draft)")
    ap.add_argument(
        "--mid-batches",
        default="2,4,8",
        help="batch sizes where n-gram speculating at any batch is timed against plain "
        "(what spec.DEFAULT_MAX_BATCH rests on); empty: skip",
    )
    ap.add_argument("--sessions", type=int, default=0, help="multi-turn sessions per workload")
    ap.add_argument("--turns", type=int, default=4, help="sessions: most turns per session")
    ap.add_argument("--workloads", default="agent,chat", help="sessions: agent, chat")
    args = ap.parse_args()
    random.seed(0)
    args.path = real_smollm2() if args.model == "smollm2" else args.model
    if args.sessions:
        results = {"machine": machine(), "args": {**vars(args), "path": str(args.path)}}
        results["sessions"] = spec_sessions.main(args, args.path)
        print("saved", save_results("spec_sessions", results))
        return
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    loads = workloads(args.prompts)
    if args.path is not None:
        loads = chat_workloads(loads, args.path)
    results: dict = {"machine": machine(), "args": {**vars(args), "path": str(args.path)}}
    results.update(batch1={}, batch={})
    for name, prompts in loads.items():
        llms = {
            m: LLM(args.path, speculative=s, max_batch=1, max_model_len=2048)
            for m, s in modes(args.k, args.path is None).items()
        }
        for llm in llms.values():  # warm-up (kernels, allocator)
            llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0))
            llm.engine.speculation.stats = SpecStats()
        rounds = [run_batch1(llms, prompts, params) for _ in range(args.batch1_rounds)]
        row = {}
        for m in llms:
            speeds = [r[m][0] for r in rounds]
            ratios = [r[m][0] / r["plain"][0] for r in rounds]
            row[m] = {
                "decode_tok_s": round(statistics.median(speeds), 1),
                "speedup": round(statistics.median(ratios), 2),  # median of per-round ratios
                "round_speedups": [round(x, 2) for x in ratios],
                "identical_to_plain": all(r[m][1] == r["plain"][1] for r in rounds),
                **(spec_summary(llms[m]) if m != "plain" else {}),
            }
        results["batch1"][name] = row
        print(f"batch 1, {name}: " + ", ".join(f"{m} {v}" for m, v in row.items()), flush=True)
        del llms

    # batch: the modes' engines loaded side by side and their runs interleaved, ratios per round
    prompts = (loads["complete"] * args.batch)[: args.batch]
    llms = {}
    for m, s in modes(args.k, args.path is None).items():
        spec = None if s is None else {**s, "max_batch": "auto"}
        llms[m] = LLM(args.path, speculative=spec, max_batch=args.batch, max_model_len=2048)
        llms[m].generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0))
        llms[m].engine.speculation.stats = SpecStats()
    runs: dict[str, list[float]] = {m: [] for m in llms}
    order = list(llms)
    for r in range(args.batch_rounds):  # each round starts with the next mode: no mode always first
        for m in order[r % len(order) :] + order[: r % len(order)]:
            runs[m].append(run_batch(llms[m], prompts, params)[0])
    for m, llm in llms.items():
        ratios = [r / p for r, p in zip(runs[m], runs["plain"], strict=True)]
        results["batch"][m] = {
            "throughput_tok_s": round(statistics.median(runs[m]), 1),
            "runs": [round(r, 1) for r in runs[m]],
            "vs_plain": round(statistics.median(ratios), 3),  # median of per-round ratios
            **(spec_summary(llm) if m != "plain" else {}),
        }
    print(f"batch {args.batch}: " + ", ".join(f"{m} {v}" for m, v in results["batch"].items()))
    results["mid_batches"] = mid_batches(loads, args, params)
    print("saved", save_results("spec", results))


def mid_batches(loads: dict, args, params: SamplingParams) -> dict:
    """n-gram with no batch cutoff against plain at small batches: where speculation still
    pays on this device (the `max_batch` "auto" table)."""
    out: dict = {}
    sizes = [int(b) for b in args.mid_batches.split(",") if b]
    for name, prompts in loads.items():
        for b in sizes:
            spec = {"method": "ngram", "num_tokens": args.k, "max_batch": None}
            llms = {
                m: LLM(args.path, speculative=s, max_batch=b, max_model_len=2048)
                for m, s in (("plain", None), ("ngram", spec))
            }
            for llm in llms.values():
                llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0))
            runs: dict[str, list[float]] = {m: [] for m in llms}
            outputs: dict[str, list] = {}
            for _ in range(args.batch_rounds):
                for m, llm in llms.items():
                    speed, outputs[m] = run_batch(llm, prompts[:b], params)
                    runs[m].append(speed)
            ratios = [s / p for s, p in zip(runs["ngram"], runs["plain"], strict=True)]
            same = sum(a == p for a, p in zip(outputs["ngram"], outputs["plain"], strict=True))
            row = {
                "plain_tok_s": [round(r, 1) for r in runs["plain"]],
                "ngram_vs_plain": round(statistics.median(ratios), 3),
                # b/b where every step runs the row-invariant native kernels (AVX-512 BF16)
                "outputs_identical_to_plain": f"{same}/{b}",
                **spec_summary(llms["ngram"]),
            }
            out[f"{name} batch {b}"] = row
            print(f"{name}, batch {b}: {row}", flush=True)
    return out


if __name__ == "__main__":
    main()
