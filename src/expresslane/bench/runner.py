"""Runs a workload against a target at one or more load levels.

- Closed loop (`concurrency=C`): C workers, each runs one session at a time and sends its next
  request as soon as the previous one ends. A request is scheduled when its worker is free.
- Open loop (`rate=R`): sessions arrive at seeded Poisson times, whatever the server is doing.
  A request's `scheduled` time is its arrival time, so a late client or a slow server shows in
  every latency (no coordinated omission).

In a session, each turn is sent with the conversation so far (earlier turns plus the
assistant's replies, tool calls included) and is scheduled `delay_s` after the previous turn
ends (a session that computes its next turn from the reply, e.g. by running tools, does so
before that); a failed turn ends its session (its remaining turns are not sent, so the run has
fewer requests). A run stops starting requests after `requests` requests or `duration`
seconds, then waits for those in flight. A session of known length reserves all its turns
when it starts; one of unknown length (agent) reserves each turn as it starts. Sessions that
report a `TaskRecord` at their end (agent tasks) have it kept in `RunResult.tasks`. A completed
request's output is checked against its turn's output format or tool_choice (`checks.py`).
Warmup requests (first turns only) run once, before the first level, sequentially, and are not
recorded. All levels share one transport (and its connections).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from expresslane.bench.checks import check_output
from expresslane.bench.records import RequestRecord, TaskRecord
from expresslane.bench.schedule import poisson_arrivals
from expresslane.bench.target import Target
from expresslane.bench.transport import Clock, Transport
from expresslane.bench.workloads import Reply, SessionLike, Workload


def make_transport(target: Target) -> Transport:
    if target.transport == "websocket":
        if target.api != "responses":
            raise ValueError("--transport websocket needs --api responses")
        from expresslane.bench.ws_client import WsTransport

        return WsTransport(target)
    from expresslane.bench.client import HttpTransport

    return HttpTransport(target)


@dataclass
class Level:
    """One run: a closed-loop concurrency or an open-loop rate."""

    concurrency: int | None = None
    rate: float | None = None

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.concurrency is not None else f"rate={self.rate:g}"


@dataclass
class RunResult:
    level: Level
    started_at: str  # ISO 8601, UTC
    duration_s: float  # run start to the last request's end
    records: list[RequestRecord] = field(default_factory=list)
    tasks: list[TaskRecord] = field(default_factory=list)  # task-shaped sessions (agent)


class Budget:
    """How many more requests a run may start, and until when."""

    def __init__(self, requests: int | None, duration_s: float | None):
        self.left = requests
        self.deadline = duration_s

    def open(self, now: float) -> bool:
        return (self.deadline is None or now < self.deadline) and self.left != 0

    def reserve(self, turns: int) -> int:
        """Up to `turns` requests for one session (0: the run is full)."""
        if self.left is None:
            return turns
        granted = min(turns, self.left)
        self.left -= granted
        return granted


async def _sleep_until(t: float, clock: Clock) -> None:
    delay = t - clock()
    if delay > 0:
        await asyncio.sleep(delay)


async def play_session(
    transport: Transport,
    session: SessionLike,
    granted: int,
    scheduled: float,
    clock: Clock,
    budget: Budget,
    on_done: Callable[[RequestRecord], None],
    on_task: Callable[[TaskRecord], None] | None = None,
) -> None:
    """Play a session: the first turn is scheduled at `scheduled`, each later one `delay_s`
    after the previous one ends. `granted` turns were reserved; a session of unknown length
    reserves each later turn as it starts."""
    start = scheduled
    history: list[dict] = []
    reply: Reply | None = None
    reason = "done"
    async with transport.session() as send:
        for i in itertools.count():
            turn = await session.next_turn(reply)
            if turn is None:
                break
            if i >= granted and (session.planned_turns is not None or not budget.reserve(1)):
                reason = "budget"
                break
            if i > 0:
                scheduled = clock() + turn.delay_s
                if budget.deadline is not None and scheduled >= budget.deadline:
                    reason = "deadline"
                    break
                await _sleep_until(scheduled, clock)
            rec = RequestRecord(
                scheduled=scheduled,
                session=session.id,
                turn=i if session.id is not None else None,
                response_format=turn.format_kind,
                tool_choice=turn.choice_kind,
            )
            history.extend(turn.messages)
            reply = await send(list(history), turn, rec, clock)
            if rec.ok:
                rec.output_check = check_output(turn, reply)
            on_done(rec)
            if not rec.ok:
                reason = "error"
                break
            history.append(reply.message())
    task = await session.end(reason)
    if task is not None and on_task is not None:
        task.session, task.start, task.end = session.id, start, clock()
        on_task(task)


def _reserve_first(session: SessionLike | None, budget: Budget) -> int:
    """The turns a new session may start with (0: the run is full or out of sessions)."""
    if session is None:
        return 0
    planned = session.planned_turns
    return budget.reserve(1 if planned is None else planned)


async def closed_loop(
    transport: Transport,
    sessions: Iterator[SessionLike],
    concurrency: int,
    budget: Budget,
    clock: Clock,
    on_done: Callable[[RequestRecord], None],
    on_task: Callable[[TaskRecord], None] | None = None,
) -> None:
    async def worker() -> None:
        while budget.open(clock()):
            session = next(sessions, None)
            turns = _reserve_first(session, budget)
            if session is None or turns == 0:
                return
            await play_session(transport, session, turns, clock(), clock, budget, on_done, on_task)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def open_loop(
    transport: Transport,
    sessions: Iterator[SessionLike],
    rate: float,
    seed: int,
    budget: Budget,
    clock: Clock,
    on_done: Callable[[RequestRecord], None],
    on_task: Callable[[TaskRecord], None] | None = None,
) -> None:
    tasks: list[asyncio.Task] = []
    for t in poisson_arrivals(rate, seed):
        if not budget.open(t):
            break
        session = next(sessions, None)
        turns = _reserve_first(session, budget)
        if session is None or turns == 0:
            break
        await _sleep_until(t, clock)
        play = play_session(transport, session, turns, t, clock, budget, on_done, on_task)
        tasks.append(asyncio.create_task(play))
    await asyncio.gather(*tasks)


async def warmup(transport: Transport, workload: Workload, n: int) -> None:
    """Send the first turns of `n` sessions one by one and forget them."""
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start
    sessions = workload.sessions()
    for _ in range(n):
        session = next(sessions, None)
        turn = None if session is None else await session.next_turn(None)
        if turn is None:
            return
        async with transport.session() as send:
            await send(list(turn.messages), turn, RequestRecord(0.0), clock)


def _progress(show: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not show,
        transient=True,
    )


async def run_level(
    transport: Transport,
    workload: Workload,
    level: Level,
    requests: int | None,
    duration_s: float | None,
    seed: int,
    progress: Progress,
) -> RunResult:
    records: list[RequestRecord] = []
    task = progress.add_task(level.label, total=requests)

    def on_done(rec: RequestRecord) -> None:
        records.append(rec)
        progress.advance(task)

    tasks: list[TaskRecord] = []

    budget = Budget(requests, duration_s)
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start
    sessions = workload.sessions()
    if level.concurrency is not None:
        await closed_loop(
            transport, sessions, level.concurrency, budget, clock, on_done, tasks.append
        )
    else:
        assert level.rate is not None
        await open_loop(transport, sessions, level.rate, seed, budget, clock, on_done, tasks.append)
    progress.remove_task(task)
    records.sort(key=lambda r: r.scheduled)
    tasks.sort(key=lambda t: t.start or 0.0)
    return RunResult(level, started_at, clock(), records, tasks)


async def run_benchmark(
    target: Target,
    workload: Workload,
    levels: list[Level],
    *,
    requests: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
    warmup_requests: int = 1,
    show_progress: bool | None = None,
) -> list[RunResult]:
    """Run every level in order; `requests`/`duration_s` both None: the workload's default."""
    if requests is None and duration_s is None:
        requests = workload.default_requests()
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    transport = make_transport(target)
    results = []
    try:
        await warmup(transport, workload, warmup_requests)
        with _progress(show_progress) as progress:
            for level in levels:
                results.append(
                    await run_level(
                        transport, workload, level, requests, duration_s, seed, progress
                    )
                )
    finally:
        await transport.aclose()
    return results
