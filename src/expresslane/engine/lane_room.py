"""Admission by prediction: whether a lane with a promise (promise.py) has room for one more
request. The step-latency model predicts the step time of the lane's requests with the new one
beside them, stretched by what the lower lanes may add under the lane's target
(`Scheduler.stretched`); there is room when each would still decode at the promised speed and
the new prompt's prefill would fit its time to first token, and none of them is measured
decoding below the promised speed lately (the model's refits follow the machine's load only
every few dozen steps). The server asks before it admits a request (a full lane then queues,
downgrades or refuses it, per the key's policy); the scheduler asks before it starts a queued
one.

The lane's promise is stated here too (`resolve`): "auto" values from the step-latency model
once it is fitted, then fixed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

from expresslane.engine.request import Request
from expresslane.engine.step_model import StepLatencyModel
from expresslane.lanes import Lane
from expresslane.promise import Stated

log = logging.getLogger("expresslane.engine")

# An "auto" promise is this fraction of the lane's per-request target: the target is what the
# scheduler aims at, the promise what is sold, with room for a busy machine's noise (on a
# 2-core CPU shared with the HTTP server, ultrafast under load kept 56-93% of its solo speed
# over starts: BENCHMARKS.md). Its floor per request is half of it again (`floor_fraction`).
PROMISE_OF_TARGET = 0.5
# An "auto" TTFT promise: this many times the predicted prefill of `prompt_tokens` alone under
# the lane's target, and at least TTFT_FLOOR_S (the server's own work: HTTP, templates).
TTFT_MARGIN = 3.0
TTFT_FLOOR_S = 0.25


class LaneRoom:
    """`stretch(lane, seconds)`: the step time the lane's requests see when their own rows
    take `seconds` and the lower lanes add what the lane's target lets them
    (`Scheduler.stretched`); `max_tokens`: the step's token budget."""

    def __init__(
        self,
        lanes: dict[str, Lane],
        step_model: StepLatencyModel,
        stretch: Callable[[str, float], float],
        max_tokens: int,
    ):
        self.lanes, self.step_model = lanes, step_model
        self.stretch, self.max_tokens = stretch, max_tokens
        self.stated: dict[str, Stated] = {}  # lane -> its promise, once resolved
        for lane in lanes.values():  # a promise of numbers is stated from the start
            if lane.promise is not None and lane.enabled and not lane.promise.is_auto:
                self.stated[lane.name] = lane.promise.stated(0.0, 0.0)

    def resolve(self, targets: dict[str, float]) -> None:
        """State each promise: "auto" parts from the lanes' resolved per-request `targets`
        (tokens/s) and the step-latency model."""
        for lane in self.lanes.values():
            if lane.promise is None or not lane.enabled or lane.name in self.stated:
                continue
            if lane.name not in targets:
                continue
            speed = PROMISE_OF_TARGET * targets[lane.name]
            prefill = self._prefill_seconds(lane.name, lane.promise.prompt_tokens, [])
            ttft = max(TTFT_FLOOR_S, TTFT_MARGIN * prefill)
            stated = lane.promise.stated(_round(speed), _round(ttft, up=True))
            self.stated[lane.name] = stated
            log.info(
                "lane %s promises %.1f tokens/s (p%g per %gs window, floor %.1f) and TTFT "
                "%.3fs per %d prompt tokens",
                lane.name,
                stated.tokens_per_s,
                stated.percentile,
                stated.window_s,
                stated.floor_tokens_per_s,
                stated.ttft_s,
                stated.prompt_tokens,
            )

    def fits(
        self, lane: str, prompt_tokens: int, beside: Sequence[Request], in_flight: int = 0
    ) -> bool:
        """Whether one more request of `lane` (a prompt of about `prompt_tokens`) keeps the
        promise of every request of the lane, itself included, beside the lane's requests
        `beside`; `in_flight` counts those handed over that the scheduler may not hold yet.
        A lane without a stated promise has room up to its max batch; a lane with nothing
        running always has room (alone, a request gets the best this machine can do)."""
        count = max(len(beside), in_flight)
        if count >= self.lanes[lane].max_batch:
            return False
        stated = self.stated.get(lane)
        if stated is None or count == 0 or not self.step_model.ready:
            return True
        if any(_slower(r, stated.tokens_per_s) for r in beside):
            return False  # measured: the machine is slower than the model knows yet
        context = sum(r.num_tokens for r in beside) + (count - len(beside)) * prompt_tokens
        speed = self.predicted_speed(lane, count + 1, context + prompt_tokens)
        prefill = self._prefill_seconds(lane, prompt_tokens, beside)
        return speed >= stated.tokens_per_s and prefill <= stated.ttft_allowed(prompt_tokens)

    def predicted_speed(self, lane: str, num_seqs: int, context_tokens: int) -> float:
        """Tokens/s per request of `lane` with `num_seqs` of them decoding (guesses aside:
        speculation only adds to it)."""
        own = self.step_model.predict(num_seqs, num_seqs, context_tokens)
        return 1.0 / max(self.stretch(lane, own), 1e-6)

    def _prefill_seconds(self, lane: str, prompt_tokens: int, beside: Sequence[Request]) -> float:
        """Predicted time to prefill a prompt in chunks beside `beside`'s decodes."""
        budget = max(1, self.max_tokens - len(beside))
        chunks = math.ceil(prompt_tokens / budget)
        context = sum(r.num_tokens for r in beside)
        seconds = 0.0
        for i in range(chunks):
            chunk = min(budget, prompt_tokens - i * budget)
            done = i * budget + chunk
            own = self.step_model.predict(len(beside) + 1, len(beside) + chunk, context + done)
            seconds += self.stretch(lane, own)
        return seconds


def _slower(req: Request, tokens_per_s: float) -> bool:
    recent = req.metrics.recent_tokens_per_s
    return recent is not None and recent < tokens_per_s


def _round(value: float, up: bool = False) -> float:
    """Two significant digits, rounded toward the safe side of a promise (a published
    number, not a measurement's noise)."""
    if value <= 0:
        return value
    scale = 10.0 ** (1 - math.floor(math.log10(value)))
    return (math.ceil if up else math.floor)(value * scale) / scale
