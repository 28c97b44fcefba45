"""Fault isolation for the model step: when a batch raises, find the requests that make it
raise and run the others without them.

The batch is split in halves, recursively, and each part runs again on its own: a part that
runs gives its rows, a single request that still raises is a culprit. A part run again computes
what it would have computed in the batch: the KV slots of its positions are written again, its
guesses are verified again, and each seeded request's generator is first set back to its state
before the step (a failed attempt may have drawn from it). Requests without a seed draw from
the sampler's shared generator, whose draws depend on the rest of the batch anyway.

When every request of a batch fails alone too, the fault is the device's or the engine's, not
a request's (`StepRun.device_fault`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from expresslane.engine.kv_cache import KVCacheManager
from expresslane.engine.request import Request
from expresslane.engine.sampler import SampleResult

log = logging.getLogger("expresslane.engine")

Items = list[tuple[Request, int]]  # (request, new tokens), as scheduled
StepFn = Callable[[Items], tuple[Items, SampleResult | None]]  # ModelRunner.step


@dataclass
class StepRun:
    items: Items  # the scheduled requests that ran
    samples: Items  # (request, rows) in the order of `result`'s rows
    result: SampleResult | None
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
    clean: bool = True  # the batch ran at the first attempt

    @property
    def device_fault(self) -> bool:
        """Every request of a batch of several failed, each on its own as well."""
        return len(self.failed) > 1 and not self.items

    def error_message(self, error: Exception) -> str:
        if self.device_fault:
            what = f"{type(error).__name__}: {error}"
            return f"internal engine error: the step failed for every request in it ({what})"
        return request_error(error)


def request_error(error: Exception) -> str:
    """The error text of a request that made the engine raise."""
    return f"the engine could not run this request: {type(error).__name__}: {error}"


def device_fault(kv: KVCacheManager, device: torch.device) -> None:
    """Every request of a step failed alone: the device, not a request, is at fault, and
    what the prefix cache holds is not trusted any more."""
    log.error("every request of the step failed: dropping the prefix cache")
    kv.drop_cached_prefixes()
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


def run_isolated(step: StepFn, items: Items) -> StepRun:
    """`step(items)`; if it raises, the parts of `items` that run without raising."""
    saved = _generator_states(items)
    try:
        samples, result = step(items)
    except Exception as e:
        log.warning(
            "engine step of %d requests failed (%s: %s): running them apart",
            len(items),
            type(e).__name__,
            e,
        )
        return _isolate(step, items, e, saved)
    return StepRun(items, samples, result)


def _isolate(step: StepFn, items: Items, error: Exception, saved) -> StepRun:
    run = StepRun([], [], None, clean=False)
    parts: list[tuple[Items, SampleResult | None]] = []
    pending = [(items, error)]  # parts that raised
    while pending:
        part, error = pending.pop()
        if len(part) == 1:
            run.failed.append((part[0][0], error))
            continue
        half = len(part) // 2
        for sub in (part[:half], part[half:]):
            _restore(saved, sub)
            try:
                samples, result = step(sub)
            except Exception as e:
                pending.append((sub, e))
                continue
            run.items += sub
            run.samples += samples
            parts.append((samples, result))
    run.result = _merge(parts)
    for req, e in run.failed:
        log.error("request %s failed the engine step: %s: %s", req.request_id, type(e).__name__, e)
    return run


def _merge(parts: list[tuple[Items, SampleResult | None]]) -> SampleResult | None:
    """One result whose rows follow the parts' samples, in order."""
    token_ids: list[int] = []
    logprobs: list[dict | None] = []
    any_logprobs = False
    for samples, result in parts:
        if result is None:
            continue  # no sampled rows (prompt chunks only)
        token_ids += result.token_ids
        if result.logprobs is None:
            logprobs += [None] * sum(n for _, n in samples)
        else:
            logprobs += result.logprobs
            any_logprobs = True
    if not token_ids:
        return None
    return SampleResult(token_ids, logprobs if any_logprobs else None)


def _generator_states(items: Items) -> list[tuple[Request, torch.Tensor | None]]:
    """Seeded requests' generator states before the step (None: not made yet)."""
    return [
        (r, None if r.generator is None else r.generator.get_state())
        for r, _ in items
        if r.params.seed is not None and not r.params.greedy
    ]


def _restore(saved: list[tuple[Request, torch.Tensor | None]], items: Items) -> None:
    members = {id(r) for r, _ in items}
    for req, state in saved:
        if id(req) not in members:
            continue
        if state is None:
            req.generator = None  # made again from the seed on first use, as it was
        else:
            req.generator.set_state(state)
