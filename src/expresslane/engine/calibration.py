"""Fitting the step-latency model before serving (`calibrate`), and the lane speed targets it
resolves (`LaneTargets`, the engine's `targets`)."""

from __future__ import annotations

import logging
from collections import deque
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
    """The whole calibration now (`Calibration`, run to its end); call it before serving."""
    calibration = Calibration(engine)
    while not calibration.done:
        calibration.step()


class Calibration:
    """The step-latency model's calibration: kept from an earlier start (calibration_cache.py),
    or measured now, one engine step at a time (`step`), so that a server serves its requests
    between the steps: it steps only while it holds no request of its own, and `interrupt`
    gives the engine back (the run in flight is measured again later). Once measured, the
    steps are fitted and kept, and the lanes' targets and promises stated from them; until
    then they are held (`LaneTargets.held`), so no promise is stated from part of it.

    Time synthetic steps on this device, prompt chunks and decode batches up to the largest
    lane batch. Uses free KV blocks only and leaves nothing behind."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.cache = CalibrationCache.of(engine.config, engine.model_dir, engine.device)
        self.rng = torch.Generator().manual_seed(0)
        self.runs: deque[tuple[int, int]] = deque()  # (index, batch) still to measure
        self.running: list[str] = []  # the run in flight: its request ids
        self._current = (0, 0)  # and its (index, batch)
        self.warmup = 0  # runs before this index warm up, not kept
        self.done = False
        if not self._take_kept():
            engine.targets.held = True
            self._plan()

    def _take_kept(self) -> bool:
        kept = self.cache.load() if self.cache is not None else None
        if kept is None:
            return False
        try:
            self.engine.step_model.restore(kept)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            log.warning("calibration %s unusable (%s): measuring anew", self.cache.path, e)
            return False
        log.info("step-latency calibration kept from an earlier start: %s", self.cache.path)
        self._state()
        return True

    def _plan(self) -> None:
        engine = self.engine
        largest = max(la.max_batch for la in engine.lanes.values() if la.enabled)
        top = min(largest, engine.config.max_batch)
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= top]
        # A request alone after every batch size: the solo samples spread over the whole
        # sweep, so a moment of load on the machine (other threads of a starting server)
        # moves few of them. The first sweep warms up (the first steps of a process run
        # slower: 20% for a decode alone on the demo model) and is not kept.
        sweep = [n for b in sizes for n in ((b,) if b == 1 else (b, 1))]
        self.warmup = len(sweep)
        self.runs.extend(enumerate(sweep * (1 + CALIBRATION_ROUNDS)))
        log.info("measuring the step-latency calibration: %d runs of steps", len(self.runs))

    def turn(self) -> bool:
        """Step once if the engine holds no request but this calibration's (True); else give
        the engine back to the server's requests (`interrupt`)."""
        if all(rid in self.running for rid in self.engine.requests):
            self.step()
            return True
        self.interrupt()
        return False

    def step(self) -> None:
        """One engine step of the run in flight, starting the next run if none is; ends the
        calibration after the last. Call it only while the engine holds no other request."""
        try:
            if not self.running:
                self._begin()
            if self.running:
                self.engine.step()
                if not self.engine.has_unfinished():
                    self.running = []
                    self.engine.step_model.calibrating = False
            if not self.running and not self.runs:
                self._finish()
        except Exception:
            log.exception("step-latency calibration failed: the model fits online instead")
            self.interrupt()
            self.runs.clear()
            self.engine.targets.held = False
            self.done = True

    def interrupt(self) -> None:
        """Abort the run in flight (requests of the server's are waiting); it runs again
        later from the start."""
        if self.running:
            for rid in self.running:
                self.engine.abort(rid)
            self.runs.appendleft(self._current)
            self.running = []
        self.engine.step_model.calibrating = False

    def _begin(self) -> None:
        engine = self.engine
        prompt_len = max(1, min(32, (engine.max_model_len - 8) // 4))  # prompts of 1-4x this
        while self.runs:
            i, b = self.runs.popleft()
            need = engine.kv.blocks_needed(prompt_len * 4 + SOLO_TOKENS) * b
            if need <= engine.kv.num_free_blocks:
                break
        else:
            return
        if i == self.warmup:
            engine.step_model.forget_live()  # the warm-up's steps
        engine.step_model.calibrating = i >= self.warmup
        params = SamplingParams(
            max_tokens=SOLO_TOKENS if b == 1 else 4, temperature=0.0, ignore_eos=True
        )
        vocab = engine.model_config.vocab_size
        self._current = (i, b)
        for j in range(b):
            n = prompt_len * (1 + j % 4)
            prompt = torch.randint(1, vocab, (n,), generator=self.rng).tolist()
            req = engine.make_request(Submission(prompt, params, f"calibrate-{i}-{j}"))
            engine.add(req)
            self.running.append(req.request_id)

    def _finish(self) -> None:
        if self.cache is not None:
            self.cache.save(self.engine.step_model.export())
        self.engine.targets.held = False
        self._state()

    def _state(self) -> None:
        self.engine.step_model.fit()
        self.engine.targets.resolve()
        self.done = True
        log.info("step-latency model: %s", self.engine.step_model.describe())


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
