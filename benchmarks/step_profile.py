"""Where a decode step's time goes: the model's forward pass against the engine's own Python
work (scheduling, input preparation, sampling, output), on CPU or CUDA.

Per batch size, `--steps` decode steps three ways, after a warm-up:
  plain     each engine.step() timed as it runs: the step as served
  forward   the same with the forward pass and the sampler synchronized and timed (CUDA
            waits added, so only their shares are read from this pass)
  profile   under cProfile: the functions with the most own time per step
On a GPU the forward pass is queued asynchronously; the host's work before it (schedule,
prepare) is on the critical path, what follows the sampler's read-back is not overlapped.

    python benchmarks/step_profile.py [--model DIR] [--device auto] [--batches 1,64] [--steps 40]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from common import SMOLLM2_135M, machine, model_vocab, random_checkpoint, save_results

from expresslane import LLM, SamplingParams

PROMPT = 64


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def start_batch(llm: LLM, batch: int, steps: int, vocab: int) -> None:
    """`batch` requests, prefilled, each with room for `steps` more decode steps."""
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for p in torch.randint(1, vocab, (batch, PROMPT), generator=g).tolist():
        llm.engine.add_request(p, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in llm.engine.requests.values()):
        llm.engine.step()


def finish(llm: LLM) -> None:
    while llm.engine.has_unfinished():
        llm.engine.step()


class Timed:
    """Wraps a callable: synchronized wall time of each call."""

    def __init__(self, fn, device: torch.device):
        self.fn, self.device, self.seconds = fn, device, []

    def __call__(self, *args, **kwargs):
        sync(self.device)
        t = time.perf_counter()
        out = self.fn(*args, **kwargs)
        sync(self.device)
        self.seconds.append(time.perf_counter() - t)
        return out


def plain_steps(llm: LLM, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        llm.engine.step()
        sync(llm.engine.device)
        out.append(time.perf_counter() - t)
    return out


def measure(llm: LLM, batch: int, steps: int, vocab: int) -> dict:
    engine, device = llm.engine, llm.engine.device
    start_batch(llm, batch, steps, vocab)
    wall = statistics.median(plain_steps(llm, steps))
    finish(llm)

    runner = engine.runner
    forward, sampler = Timed(runner.model, device), Timed(runner.sampler, device)
    runner.model, runner.sampler = forward, sampler
    start_batch(llm, batch, steps, vocab)
    forward.seconds.clear()
    sampler.seconds.clear()
    synced = statistics.median(plain_steps(llm, steps))
    runner.model, runner.sampler = forward.fn, sampler.fn
    finish(llm)

    start_batch(llm, batch, steps, vocab)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    finish(llm)
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:12]
    top = [
        {"function": f"{file.rsplit('/', 1)[-1]}:{line}({name})", "ms_per_step": own / steps * 1e3}
        for (file, line, name), (_, _, own, _, _) in rows
    ]
    forward_ms = statistics.median(forward.seconds) * 1e3
    sampler_ms = statistics.median(sampler.seconds) * 1e3
    return {
        "step_ms": wall * 1e3,
        "synced_step_ms": synced * 1e3,
        "forward_ms": forward_ms,
        "sampler_ms": sampler_ms,
        "host_ms": max(0.0, synced * 1e3 - forward_ms - sampler_ms),
        "host_share": max(0.0, 1 - (forward_ms + sampler_ms) / (synced * 1e3)),
        "top_own_time": top,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a checkpoint (random SmolLM2-135M)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    path = args.model or str(random_checkpoint("smollm2-135m", SMOLLM2_135M))
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(
        str(path),
        device=args.device,
        max_model_len=PROMPT + args.steps + 16,
        max_batch=max(batches),
        enable_prefix_caching=False,
    )
    vocab = model_vocab(path)
    start_batch(llm, 2, 4, vocab)  # warm-up
    finish(llm)
    results = {"machine": machine(), "device": str(llm.engine.device), "model": str(path)}
    for b in batches:
        row = measure(llm, b, args.steps, vocab)
        results[f"batch_{b}"] = row
        print(
            f"batch {b}: step {row['step_ms']:.2f} ms | synchronized: forward "
            f"{row['forward_ms']:.2f}, sampler {row['sampler_ms']:.2f}, the rest (host) "
            f"{row['host_ms']:.2f} ms = {100 * row['host_share']:.0f}% of the step",
            flush=True,
        )
        for t in row["top_own_time"][:6]:
            print(f"    {t['ms_per_step']:7.3f} ms  {t['function']}")
    print(f"saved {save_results('step_profile', results)}")


if __name__ == "__main__":
    main()
