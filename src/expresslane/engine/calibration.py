"""Fitting the step-latency model before serving (`calibrate`), and the lane speed targets it
resolves (`LaneTargets`, the engine's `targets`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from expresslane.engine.calibration_cache import CalibrationCache
from expresslane.engine.submission import Submission
from expresslane.sampling_params import SamplingParams

if TYPE_CHECKING:
    from expresslane.engine.engine import LLMEngine
    from expresslane.engine.scheduler import Scheduler
    from expresslane.engine.step_model import StepLatencyModel
    from expresslane.lanes import Lane

log = logging.getLogger("expresslane.engine")


# The sweep of batch sizes runs this many times; the step model is fitted to each step
# shape's median time, so a burst of load on the machine during startup moves it little.
CALIBRATION_ROUNDS = 3
# A request alone decodes this many tokens per round: the solo speed "auto" targets follow
# comes from these steps' times (`StepLatencyModel.solo_step`).
SOLO_TOKENS = 16


def calibrate(engine: LLMEngine) -> None:
    """Fit the step-latency model to this machine's calibration, kept from an earlier start
    (calibration_cache.py) or measured now and kept; then state the lanes' targets and
    promises from it. Call it before serving."""
    cache = CalibrationCache.of(engine.config, engine.config.model_dir, engine.device)
    kept = cache.load() if cache is not None else None
    if kept is not None:
        try:
            engine.step_model.restore(kept)
            log.info("step-latency calibration kept from an earlier start: %s", cache.path)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            log.warning("calibration %s unusable (%s): measuring anew", cache.path, e)
            kept = None
    if kept is None:
        engine.targets.held = True  # stated from the whole calibration, not its first steps
        try:
            measure(engine)
        finally:
            engine.targets.held = False
        if cache is not None:
            cache.save(engine.step_model.export())
    engine.step_model.fit()
    engine.targets.resolve()
    log.info("step-latency model: %s", engine.step_model.describe())


def measure(engine: LLMEngine) -> None:
    """Time synthetic steps on this device, prompt chunks and decode batches up to the largest
    lane batch, into the step-latency model's calibration set. Uses free KV blocks only and
    leaves nothing behind."""
    rng = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    largest = max(la.max_batch for la in engine.lanes.values() if la.enabled)
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= min(largest, engine.config.max_batch)]
    prompt_len = max(1, min(32, (engine.max_model_len - 8) // 4))  # prompts of 1-4x this
    # A request alone after every batch size: the solo samples spread over the whole sweep,
    # so a moment of load on the machine (other threads of a starting server) moves few of
    # them. The first sweep warms up (the first steps of a process run slower: 20% for a
    # decode alone on the demo model) and is not kept.
    sweep = [n for b in sizes for n in ((b,) if b == 1 else (b, 1))]
    runs = sweep * (1 + CALIBRATION_ROUNDS)
    try:
        for i, b in enumerate(runs):
            if (
                engine.kv.blocks_needed(prompt_len * 4 + SOLO_TOKENS) * b
                > engine.kv.num_free_blocks
            ):
                continue
            if i == len(sweep):
                engine.step_model.forget_live()  # the warm-up's steps
            engine.step_model.calibrating = i >= len(sweep)
            params = SamplingParams(
                max_tokens=SOLO_TOKENS if b == 1 else 4, temperature=0.0, ignore_eos=True
            )
            for j in range(b):
                n = prompt_len * (1 + j % 4)
                prompt = torch.randint(1, vocab, (n,), generator=rng).tolist()
                engine.add(engine.make_request(Submission(prompt, params, f"calibrate-{i}-{j}")))
            while engine.has_unfinished():
                engine.step()
    finally:
        engine.step_model.calibrating = False
        for rid in list(engine.requests):
            engine.abort(rid)


class LaneTargets:
    """The lanes' speed targets, handed to the scheduler once the step-latency model is
    fitted (`resolve`), and what they are worth in tokens/s per request (`per_request`)."""

    def __init__(self, lanes: dict[str, Lane], scheduler: Scheduler, step_model: StepLatencyModel):
        self.lanes, self.scheduler, self.step_model = lanes, scheduler, step_model
        self.resolved = False
        self.held = False  # while calibrating: its first fits are no measure to state

    @property
    def due(self) -> bool:
        """Whether the targets can be resolved now and are not yet."""
        return not self.resolved and not self.held and self.step_model.ready

    def resolve(self) -> None:
        """Hand the lanes' targets to the scheduler: numbers as tokens/s, "auto" as a
        fraction of the speed the lane's requests get alone."""
        for lane in self.lanes.values():
            target = lane.target_tokens_per_s
            auto = target == "auto"
            self.scheduler.set_solo_fraction(lane.name, lane.solo_fraction if auto else None)
            tokens_per_s = None if auto or target is None else float(target)
            self.scheduler.set_target(lane.name, tokens_per_s)
        per_request = self.per_request()
        for lane, tokens_per_s in per_request.items():
            log.info("lane %s: target %.0f tokens/s per request", lane, tokens_per_s)
        self.scheduler.room.resolve(per_request)
        self.resolved = True

    def solo_tokens_per_s(self) -> float:
        """The speed of one request decoding alone, without guesses: from the measured
        decodes alone (calibration's, then the latest live ones), else the model's
        prediction."""
        model = self.step_model
        seconds = model.solo_step() or model.predict(1, 1, 256)
        return 1 / max(seconds, 1e-4)

    def per_request(self) -> dict[str, float]:
        """Each targeted lane's per-request speed target in tokens/s (what /metrics
        reports): an "auto" lane's is its fraction of the solo speed, which follows the
        model's refits."""
        scheduler, out = self.scheduler, {}
        for name in self.lanes:
            if name in scheduler.targets:
                out[name] = scheduler.targets[name]
            elif name in scheduler.solo_fractions and self.step_model.ready:
                out[name] = scheduler.solo_fractions[name] * self.solo_tokens_per_s()
        return out
