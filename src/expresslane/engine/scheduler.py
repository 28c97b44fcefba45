"""Continuous batching: which requests run this step and how many tokens each computes.

Every step has a token budget. Running requests go first (decodes cost one token each, an
unfinished prompt continues as a chunk), then waiting requests are admitted in priority order
while budget, sequence slots and KV blocks last. A prompt larger than the remaining budget is
split into chunks across steps (chunked prefill), mixed with the decodes. When blocks run out
the lowest-priority, most recent running request is preempted: its blocks are released and it
is recomputed later (its cached prefix blocks often survive and make that cheap).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from expresslane.engine.kv_cache import KVCacheManager
from expresslane.engine.request import Request, Status


@dataclass
class ScheduledBatch:
    items: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        bisect.insort(self.waiting, req, key=Request.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take a finished or aborted request out and release its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.release(req)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        # Within a priority level, decodes go before prompt chunks so a long prompt never
        # stalls the streams that are already generating.
        order = sorted(self.running, key=_running_order)
        for req in order:
            if budget <= 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this step
            todo = req.num_tokens - req.num_computed_tokens
            n = min(todo + len(req.draft_ids), budget)
            del req.draft_ids[max(0, n - todo) :]  # guesses beyond the budget are dropped
            while not self.kv.allocate(req, req.num_computed_tokens + n):
                victim = self._pick_victim(order, scheduled)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                batch.items.append((req, n))
                scheduled.add(id(req))
                budget -= n
        if not batch.preempted:
            self._admit(batch, budget)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.acquire_prefix(req)
            n = min(req.num_tokens - cached, budget)
            if not self.kv.allocate(req, cached + n):
                self.kv.release(req)  # its prefix blocks stay cached for the next try
                break
            req.num_computed_tokens = cached
            if req.metrics.num_preemptions == 0:
                req.num_cached_tokens = cached
            self.waiting.pop(0)
            req.status = Status.RUNNING
            self.running.append(req)
            batch.items.append((req, n))
            budget -= n

    def _pick_victim(self, order: list[Request], scheduled: set[int]) -> Request:
        """The lowest-priority, most recent running request not yet scheduled this step."""
        candidates = [r for r in order if r.status is Status.RUNNING and id(r) not in scheduled]
        if not candidates:
            raise RuntimeError("KV cache too small for the requests scheduled in one step")
        return max(candidates, key=Request.sort_key)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.draft_ids = []
        self.kv.release(req)
        req.num_computed_tokens = 0
        req.metrics.num_preemptions += 1
        self.add(req)


def _running_order(req: Request) -> tuple[int, bool, float]:
    return (req.priority, req.num_tokens - req.num_computed_tokens > 1, req.metrics.arrival)
