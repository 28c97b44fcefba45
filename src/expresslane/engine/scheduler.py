"""Continuous batching over lanes: which requests run this step and how many tokens each computes.

Every step has a token budget. Running requests go first in lane order (ultrafast, default, flex;
decodes before prompt chunks, least recently scheduled first), then waiting requests are admitted
in lane order while budget, sequence slots, the lane's own batch limit and KV blocks last. A
prompt larger than the remaining budget is split into chunks across steps (chunked prefill).

While a request of a lane with a speed target is active, the lower lanes only get what fits in
the step time that keeps it at its target, as predicted by the step-latency model: the rest of
their requests keep their KV and skip the step (round robin makes them take turns). A target is
either relative (`solo_fractions`: the lane's requests keep this fraction of the speed they get
alone, so the lower lanes may add up to 1/fraction - 1 of the step time the lane takes itself,
on average, measured as well as predicted: engine/step_credit.py) or absolute (`targets`,
tokens/s per request). Under an absolute target the lower lanes always get at least
`LOWER_LANE_SHARE` of the step time the targeted lanes take themselves. Either way a busy
ultrafast lane slows the others but never stops them.

Within a lane, one tenant (API key) holds at most its `key_share` of the lane's running slots
(engine/tenant_shares.py).

When blocks run out, the lowest-ranked, most recent running request is preempted: its blocks are
released and it is recomputed later, prompt and output so far (its cached prefix blocks often
survive and make that cheap). A preemptible lane (flex) also gives way to a better-ranked
request that is waiting for blocks or a sequence slot.
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field

from expresslane.config import EngineConfig
from expresslane.engine.kv_cache import KVCacheManager
from expresslane.engine.lane_room import LaneRoom
from expresslane.engine.request import Request, Status
from expresslane.engine.step_credit import StepCredit
from expresslane.engine.step_model import StepLatencyModel
from expresslane.engine.tenant_shares import TenantShares
from expresslane.lanes import Lane, build_lanes

# The predicted step time is held at this fraction of the target's: on a busy machine the
# 99th-percentile inter-token gap a client sees is about twice the typical step (scheduling
# noise, refits, the server's own threads), and the target is a promise about that p99.
STEP_HEADROOM = 0.4
# Where the targeted lanes alone fill the step time their targets allow, the lower lanes may
# still add this fraction of it: the targeted requests lose at most 1 - 1/1.15 of their speed.
LOWER_LANE_SHARE = 0.15


@dataclass
class ScheduledBatch:
    items: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)
    num_tokens: int = 0  # new tokens this step, summed over sequences
    context_tokens: int = 0  # KV positions attended this step, summed over sequences

    def add(self, req: Request, n: int) -> None:
        self.items.append((req, n))
        self.num_tokens += n
        self.context_tokens += req.num_computed_tokens + n


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        lanes: dict[str, Lane] | None = None,
        step_model: StepLatencyModel | None = None,
    ):
        self.kv = kv
        self.max_num_seqs = config.max_batch
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.lanes = lanes or build_lanes(None)
        self.lane_order = sorted(self.lanes, key=lambda name: self.lanes[name].rank)
        self.step_model = step_model or StepLatencyModel()
        # Resolved per-request targets (tokens/s) of the lanes that have one (`set_target`).
        self.targets: dict[str, float] = {}
        # Lanes held at a fraction of their solo speed (`set_solo_fraction`).
        self.solo_fractions: dict[str, float] = {}
        # Step time the lower lanes saved up under a relative target (engine/step_credit.py)
        self.credit = StepCredit()
        self._targeted_rows = 0  # rows scheduled when the lower lanes' cap was set
        # mean tokens a request gains per step, per speculating lane (`observe_tokens_per_step`)
        self.tokens_per_step: dict[str, float] = {}
        self.waiting: list[Request] = []  # sorted by (lane rank, arrival)
        self.running: list[Request] = []
        self.num_steps = 0
        self._turns = itertools.count(1)  # a request's turn: when it was last scheduled
        # whether a lane with a promise has room for one more (admission by prediction)
        self.room = LaneRoom(
            self.lanes, self.step_model, self.stretched, self.max_num_batched_tokens
        )

    def set_target(self, lane: str, tokens_per_s: float | None) -> None:
        """Hold `lane`'s requests at `tokens_per_s` each (None: no target)."""
        if tokens_per_s is None:
            self.targets.pop(lane, None)
        else:
            self.targets[lane] = tokens_per_s

    def set_solo_fraction(self, lane: str, fraction: float | None) -> None:
        """Keep `lane`'s requests at `fraction` of the speed they get alone (None: no such
        target): the lower lanes add 1/fraction - 1 of the lane's own step time, on average."""
        if fraction is None:
            self.solo_fractions.pop(lane, None)
        else:
            self.solo_fractions[lane] = fraction

    def stretched(self, lane: str, seconds: float) -> float:
        """The step time `lane`'s requests see when their own rows take `seconds` and the
        lower lanes, busy, add all that the lane's target lets them."""
        fraction = self.solo_fractions.get(lane)
        if fraction is not None:
            return seconds / fraction
        target = self.targets.get(lane)
        if target is None:
            return seconds
        limit = STEP_HEADROOM * self.tokens_per_step.get(lane, 1.0) / target
        return max(seconds * (1 + LOWER_LANE_SHARE), limit)

    def has_room(self, lane: str, prompt_tokens: int, in_flight: int = 0) -> bool:
        """Whether `lane` can take one more request now and keep its promise (`LaneRoom`);
        safe from another thread: the lists are copied first."""
        held = [r for r in (*list(self.running), *list(self.waiting)) if r.lane == lane]
        return self.room.fits(lane, prompt_tokens, held, in_flight)

    def targeted(self, lane: str) -> bool:
        """Whether `lane` holds the lower lanes back for its own speed."""
        return lane in self.targets or lane in self.solo_fractions

    def observe_tokens_per_step(self, lane: str, tokens: int) -> None:
        """A request of a speculating `lane` gained `tokens` in a step (a running mean)."""
        mean = self.tokens_per_step.get(lane, 1.0)
        self.tokens_per_step[lane] = 0.95 * mean + 0.05 * tokens  # the past fades by 5% a step

    def rank(self, req: Request) -> int:
        """Its lane's scheduling order: lower ranks are scheduled first (as in vLLM)."""
        return self.lanes[req.lane].rank

    def order_key(self, req: Request) -> tuple[int, float]:
        return (self.rank(req), req.metrics.arrival)

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        req.metrics.queued = time.perf_counter()
        bisect.insort(self.waiting, req, key=self.order_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take a finished or aborted request out and release its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.release(req)

    def step_time_limit(self) -> float | None:
        """Seconds a step may take so every active request with a target keeps it: those
        running, and those waiting that could start now (one that waits for a sequence slot
        starts only as the others finish, so capping them on its behalf would starve all)."""
        limit = None
        for req in (*self.running, *self._startable()):
            target = self.targets.get(req.lane)
            if target is not None:
                tokens = self.tokens_per_step.get(req.lane, 1.0)
                per_step = STEP_HEADROOM * tokens / target
                limit = per_step if limit is None else min(limit, per_step)
        return limit if self.step_model.ready else None

    def _startable(self) -> list[Request]:
        if len(self.running) >= self.max_num_seqs:
            return []
        running = _count_by_lane(self.running)
        return [
            r
            for r in self.waiting
            if self.targeted(r.lane) and running.get(r.lane, 0) < self.lanes[r.lane].max_batch
        ]

    def schedule(self) -> ScheduledBatch:
        self.num_steps += 1
        batch = ScheduledBatch()
        self._make_room_for_waiting(batch)
        limit = self.step_time_limit()
        by_lane: dict[str, list[Request]] = {}
        for req in self.running:
            by_lane.setdefault(req.lane, []).append(req)
        out_of_blocks = admission_closed = False
        lower_cap: float | None = None  # set once the targeted lanes are scheduled
        for lane in self.lane_order:
            if self.targeted(lane):
                cap = None
            else:
                if lower_cap is None:
                    lower_cap = self._lower_lane_cap(batch, limit)
                cap = lower_cap
            running = by_lane.get(lane, [])
            if cap is not None and self._fit(batch, None, 1, cap) == 0:
                continue  # not even one token fits: the lane waits, without being looked at
            out_of_blocks |= self._schedule_running(batch, sorted(running, key=self._turn), cap)
            # A lane's new requests come before the next lane's running ones, and never
            # jump ahead of a better lane that could not admit its own.
            if not (out_of_blocks or admission_closed):
                admission_closed = self._admit(batch, lane, len(running), cap)
        seconds = self.step_model.predict(len(batch.items), batch.num_tokens, batch.context_tokens)
        self.credit.close(seconds, len(batch.items) > self._targeted_rows)
        return batch

    def _schedule_running(
        self, batch: ScheduledBatch, order: list[Request], cap: float | None
    ) -> bool:
        """Schedule one lane's running requests in turn order; True if blocks ran out."""
        out_of_blocks = False
        for req in order:
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this step
            budget = self.max_num_batched_tokens - batch.num_tokens
            if budget <= 0:
                break
            todo = req.num_tokens - req.num_computed_tokens
            n = min(todo + len(req.spec.guesses), budget)
            if cap is not None:
                n = self._fit(batch, req, n, cap)
                if n == 0:  # capped this step: it and the lane's later ones keep their
                    break  # blocks and turns (no per-request work while capped)
            req.spec.keep_guesses(max(0, n - todo))  # guesses beyond the budget are dropped
            while not self.kv.allocate(req, req.num_computed_tokens + n):
                out_of_blocks = True
                victim = self._pick_victim(batch)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                batch.add(req, n)
                req.turn = next(self._turns)
        return out_of_blocks

    def _lower_lane_cap(self, batch: ScheduledBatch, limit: float | None) -> float | None:
        """The step time a lane without a target may fill, given what the targeted lanes
        took of this step so far: the absolute targets' limit (or a share on top of the
        targeted lanes' time, whichever is more), and the relative targets' bound."""
        if not batch.items or not self.step_model.ready:
            return limit
        so_far = self.step_model.predict(len(batch.items), batch.num_tokens, batch.context_tokens)
        caps = [] if limit is None else [max(limit, so_far * (1 + LOWER_LANE_SHARE))]
        fractions = [
            self.solo_fractions[r.lane] for r, _ in batch.items if r.lane in self.solo_fractions
        ]
        if fractions:
            self._targeted_rows = len(batch.items)
            caps.append(self.credit.open(so_far, min(fractions)))
        return min(caps, default=None)

    def _fit(self, batch: ScheduledBatch, req: Request | None, n: int, limit: float) -> int:
        """The most of `n` tokens of `req` that keep the predicted step time within `limit`
        (None: of a request with nothing cached, the cheapest there can be)."""
        ctx = batch.context_tokens + (0 if req is None else req.num_computed_tokens)
        return self.step_model.most_tokens(len(batch.items) + 1, batch.num_tokens, ctx, n, limit)

    def _admit(
        self, batch: ScheduledBatch, lane: str, lane_running: int, cap: float | None
    ) -> bool:
        """Admit waiting requests of one lane (`lane_running` of it running); True if
        admission stopped for lack of budget, sequence slots, blocks or step time (so later
        lanes must wait too)."""
        promised = lane in self.room.stated
        waiting = [r for r in self.waiting if r.lane == lane]
        shares = TenantShares(self.lanes[lane], self.running)
        for req in waiting:
            if lane_running >= self.lanes[lane].max_batch:
                return False  # this lane is full; the next one may still have room
            if shares.held_back(req):
                continue
            if promised and not self._keeps_promise(req):
                return False  # it waits until the lane's promise has room for it
            budget = self.max_num_batched_tokens - batch.num_tokens
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return True
            cached = self.kv.acquire_prefix(req)
            req.num_computed_tokens = cached
            n = min(req.num_tokens - cached, budget)
            if cap is not None:
                n = self._fit(batch, req, n, cap)
            if n == 0 or not self.kv.allocate(req, cached + n):
                self.kv.release(req)  # its prefix blocks stay cached for the next try
                req.num_computed_tokens = 0
                return True
            if req.metrics.num_preemptions == 0:
                req.num_cached_tokens = cached
            self.waiting.remove(req)
            req.status = Status.RUNNING
            req.turn = next(self._turns)
            self.running.append(req)
            shares.started(req)
            lane_running += 1
            batch.add(req, n)
        return False

    def _keeps_promise(self, req: Request) -> bool:
        beside = [r for r in self.running if r.lane == req.lane]
        return self.room.fits(req.lane, req.num_tokens, beside)

    def _make_room_for_waiting(self, batch: ScheduledBatch) -> None:
        """Preempt preemptible requests that stand in the way of a better-ranked waiting one
        (one that could start: a request its lane's promise holds back preempts nothing)."""
        running_by_lane = _count_by_lane(self.running)
        head = next(
            (
                r
                for r in self.waiting
                if running_by_lane.get(r.lane, 0) < self.lanes[r.lane].max_batch
                and (r.lane not in self.room.stated or self._keeps_promise(r))
            ),
            None,
        )
        if head is None:
            return
        need = self.kv.blocks_needed(min(head.num_tokens, self.max_num_batched_tokens))
        while len(self.running) >= self.max_num_seqs or not self.kv.has_free(need):
            head_rank = self.rank(head)
            victims = [
                r
                for r in self.running
                if self.rank(r) > head_rank and self.lanes[r.lane].preemptible
            ]
            if not victims:
                return
            victim = max(victims, key=self.order_key)
            self._preempt(victim)
            batch.preempted.append(victim)

    def _pick_victim(self, batch: ScheduledBatch) -> Request:
        """The lowest-ranked, most recent running request not yet scheduled this step."""
        scheduled = {id(r) for r, _ in batch.items}
        candidates = [r for r in self.running if id(r) not in scheduled]
        if not candidates:
            raise RuntimeError("KV cache too small for the requests scheduled in one step")
        return max(candidates, key=self.order_key)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.spec.keep_guesses(0)
        self.kv.release(req)
        req.num_computed_tokens = 0
        req.metrics.num_preemptions += 1
        self.add(req)

    @staticmethod
    def _turn(req: Request) -> tuple[bool, int, float]:
        # Within a lane, decodes take turns (least recently scheduled first, in the order
        # they ran) when a cap leaves some out; prompt chunks stay first come, first served,
        # finishing prompts soonest.
        prefill = req.num_tokens - req.num_computed_tokens > 1
        return (prefill, 0 if prefill else req.turn, req.metrics.arrival)


def _count_by_lane(reqs: list[Request]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in reqs:
        counts[r.lane] = counts.get(r.lane, 0) + 1
    return counts
