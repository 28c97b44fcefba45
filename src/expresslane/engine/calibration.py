"""Fitting the step-latency model before serving, and the lane speed targets it resolves."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from expresslane.lanes import AUTO_TARGET_FRACTION
from expresslane.sampling_params import SamplingParams

if TYPE_CHECKING:
    from expresslane.engine.engine import LLMEngine

log = logging.getLogger("expresslane.engine")


def calibrate(engine: LLMEngine) -> None:
    """Time synthetic steps on this device, prompt chunks and decode batches up to the largest
    lane batch, and fit the step-latency model to them. Uses free KV blocks only and leaves
    nothing behind; call it before serving."""
    rng = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    largest = max(la.max_batch for la in engine.lanes.values() if la.enabled)
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= min(largest, engine.config.max_batch)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt_len = max(1, min(32, (engine.max_model_len - 8) // 4))  # prompts of 1-4x this
    try:
        for i, b in enumerate([1, *sizes]):  # the first run warms up and is not kept
            if engine.kv.blocks_needed(prompt_len * 4 + 8) * b > engine.kv.num_free_blocks:
                break
            engine._calibrating = i > 0
            for j in range(b):
                n = prompt_len * (1 + j % 4)
                prompt = torch.randint(1, vocab, (n,), generator=rng).tolist()
                engine.add(engine.make_request(prompt, params, f"calibrate-{i}-{j}"))
            while engine.has_unfinished():
                engine.step()
    finally:
        engine._calibrating = False
        for rid in list(engine.requests):
            engine.abort(rid)
    engine.step_model.fit()
    resolve_targets(engine)
    log.info("step-latency model: %s", engine.step_model.describe())


def resolve_targets(engine: LLMEngine) -> None:
    """Per-request tokens/s targets of lanes that have one; "auto" is a fraction of the speed
    a single request gets alone on this device."""
    for lane in engine.lanes.values():
        target = lane.target_tokens_per_s
        if target == "auto":
            target = AUTO_TARGET_FRACTION / max(engine.step_model.predict(1, 1, 256), 1e-4)
        if target is not None:
            target = float(target)
            log.info("lane %s: target %.0f tokens/s per request", lane.name, target)
        engine.scheduler.set_target(lane.name, target)
    engine._targets_resolved = True
