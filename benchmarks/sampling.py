"""Sampling cost per decode step. `draws`: the native CPU kernel (kernels/sample_cpu.cpp)
against the PyTorch path of the same sampler (softmax, sorts for top-k/top-p, a float64
cumsum), same logits, same run. `steps`: the whole sampler step (penalties, logit_bias,
logprobs) at batch 64, and `verify`: the sampler step of speculative verifications, both for
comparing two versions of the code (run it with each on PYTHONPATH).

Logits: random normal x 3 over SmolLM2's 49,152-token vocabulary (a flat distribution: top_p
keeps thousands of tokens, the hard case for a sort-free filter). Each setting is timed at
each batch size, the two paths in turns; ms per step, the median of `--repeats` steps. In
`steps` each request has 128 prompt and 200 output tokens.

    python benchmarks/sampling.py [--only draws|steps|verify] [--batches 1,16,64] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import machine, save_results

from expresslane import SamplingParams
from expresslane.engine.request import Request
from expresslane.engine.sampler import Sampler

STEPS = {
    "temperature 1": dict(temperature=1.0),
    "frequency 0.5, presence 0.3": dict(frequency_penalty=0.5, presence_penalty=0.3),
    "repetition 1.1": dict(repetition_penalty=1.1),
    "logit_bias (2 tokens)": dict(logit_bias={5: 2.0, 7: -3.0}),
    "logprobs 5": dict(logprobs=5),
}
SETTINGS = {
    "temperature 1": dict(temperature=1.0),
    "temperature 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "top_k 50": dict(top_k=50),
    "min_p 0.05, top_p 0.95": dict(min_p=0.05, top_p=0.95),
}


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def compare(sampler: Sampler, logits: torch.Tensor, reqs: list[Request], repeats: int):
    """(PyTorch ms, native ms): the medians of three turns of each."""
    from expresslane.engine.sampler import filtered_probs, inverse_cdf  # not in older code

    def native():
        sampler(logits, reqs)

    def python():
        probs = filtered_probs(logits, *sampler.settings(reqs))
        inverse_cdf(probs, torch.cat([sampler.uniform(r) for r in reqs]))

    native(), python()  # warm-up
    turns = [(timed(python, repeats), timed(native, repeats)) for _ in range(3)]
    return tuple(statistics.median(t) for t in zip(*turns, strict=True))


def draws(args) -> list[dict]:
    sampler = Sampler(torch.device("cpu"), seed=0)
    rows = []
    print("| setting | batch | PyTorch ms | native ms | speedup |\n|---|---|---|---|---|")
    for name, kw in SETTINGS.items():
        for b in [int(x) for x in args.batches.split(",")]:
            logits = torch.randn(b, args.vocab, generator=torch.Generator().manual_seed(b)) * 3
            reqs = [Request(f"r{i}", [1], SamplingParams(**kw), max_tokens=8) for i in range(b)]
            t_py, t_native = compare(sampler, logits, reqs, args.repeats)
            rows.append(dict(setting=name, batch=b, pytorch_ms=t_py, native_ms=t_native))
            print(f"| {name} | {b} | {t_py:.2f} | {t_native:.2f} | {t_py / t_native:.1f}x |")
    return rows


def steps(args, batch: int = 64) -> list[dict]:
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.randn(batch, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    rows = []
    print(f"| setting, batch {batch} | sampler step ms |\n|---|---|")
    for name, kw in STEPS.items():
        reqs = []
        for i in range(batch):
            r = Request(f"r{i}", list(range(i, i + 128)), SamplingParams(**kw), max_tokens=400)
            r.token_ids += list(range(1000 + i, 1200 + i))  # its output so far
            reqs.append(r)
        ms = median_ms(sampler, logits, reqs, [0] * batch, args.repeats)
        rows.append(dict(setting=name, batch=batch, step_ms=ms))
        print(f"| {name} | {ms:.2f} |")
    return rows


def verify(args, guesses: int = 12) -> list[dict]:
    """The sampler step of speculative verifications: windows of 12 guesses + 1 (n-gram)."""
    rows = []
    print(f"| setting | windows of {guesses} + 1 rows | sampler step ms |\n|---|---|---|")
    for name in ("temperature 1", "temperature 0.7, top_p 0.9"):
        for n in (1, 4):
            reqs, offsets = [], []
            for i in range(n):
                r = Request(f"r{i}", [1, 2, 3], SamplingParams(**SETTINGS[name]), max_tokens=99)
                r.spec.guesses = list(range(10, 10 + guesses))
                reqs += [r] * (guesses + 1)
                offsets += list(range(guesses + 1))
            logits = torch.randn(len(reqs), args.vocab) * 3
            sampler = Sampler(torch.device("cpu"), seed=0)
            ms = median_ms(sampler, logits, reqs, offsets, args.repeats)
            rows.append(dict(setting=name, windows=n, step_ms=ms))
            print(f"| {name} | {n} | {ms:.2f} |")
    return rows


def median_ms(sampler: Sampler, logits, reqs: list[Request], offsets: list[int], repeats: int):
    """The median ms of a sampler step on a fresh copy of `logits` each time (a step may
    change them in place)."""
    times = []
    for _ in range(repeats):
        x = logits.clone()
        t = time.perf_counter()
        sampler(x, reqs, offsets)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--only", choices=["draws", "steps", "verify"])
    args = ap.parse_args()
    results = {"machine": machine(), "vocab": args.vocab}
    if args.only in (None, "draws"):
        results["draws"] = draws(args)
    if args.only in (None, "steps"):
        results["steps"] = steps(args)
    if args.only in (None, "verify"):
        results["verify"] = verify(args)
    save_results("sampling", results)


if __name__ == "__main__":
    main()
