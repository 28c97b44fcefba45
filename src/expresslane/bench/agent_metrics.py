"""Agent task metrics: where each task's time went, and a run's `agent` summary block.

A task's components come from its `TaskRecord` and the `RequestRecord`s of its session;
`AGENT_DEFINITIONS` is the text the report carries.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from expresslane.bench.metrics import output_tokens
from expresslane.bench.records import RequestRecord, TaskRecord

AGENT_DEFINITIONS = """\
Agent tasks (`--workload agent`): a task's time runs from when its session was scheduled to
start (as for requests: no coordinated omission) to the end of its verification, and is split
into five parts that add up to it exactly:

- **queue + prompt** (`queue_prompt_s`) = Σ over the task's requests of (first output chunk −
  request sent): the server queues the request and processes its prompt (the whole
  conversation so far, less any prefix-cache hit; cached tokens are in `cached_tokens`). It
  also holds network time and any retries. A request that produced no output counts whole.
  A server that holds back a tool call until it is complete puts its decode time here too.
- **generation** (`generation_s`) = Σ (last byte received − first output chunk): decoding.
- **tools** (`tool_s`) = time running the tools the replies called (real tools in a temporary
  copy of the task, or the `--tool-time` delays) and applying a code-block patch.
- **verification** (`verification_s`) = running the task's check once after the last turn.
- **client overhead** (`client_overhead_s`) = task time − the four above: the client's own
  work and waits between requests (building requests, a late event loop, sandbox setup).
- **accepted**: the final check exited with 0 (null when not verified: `--tool-time`). The
  acceptance rate is accepted / verified tasks. **turns** = requests the task sent.
- Summaries give each part's mean, median (p50) and total over a run's tasks;
  `tasks_per_hour` = tasks / run wall time.
"""

COMPONENTS = ("queue_prompt_s", "generation_s", "tool_s", "verification_s", "client_overhead_s")
TITLES = {
    "queue_prompt_s": "queue + prompt",
    "generation_s": "generation",
    "tool_s": "tools",
    "verification_s": "verification",
    "client_overhead_s": "client overhead",
}
COUNTS = ("turns", "tool_calls", "input_tokens", "cached_tokens", "output_tokens")


def task_breakdown(task: TaskRecord, records: list[RequestRecord]) -> dict[str, Any]:
    """The task's time split and totals; `records` may hold other sessions' requests."""
    mine = [r for r in records if r.session == task.session]
    queue_prompt = generation = 0.0
    for r in mine:
        if r.sent is None or r.end is None:
            continue
        if r.first_token is None:
            queue_prompt += r.end - r.sent
        else:
            queue_prompt += r.first_token - r.sent
            generation += r.end - r.first_token
    total = (task.end or 0.0) - (task.start or 0.0)
    known = queue_prompt + generation + task.tool_s + task.verification_s
    return {
        "task_s": total,
        "queue_prompt_s": queue_prompt,
        "generation_s": generation,
        "tool_s": task.tool_s,
        "verification_s": task.verification_s,
        "client_overhead_s": total - known,
        "turns": len(mine),
        "input_tokens": sum(r.input_tokens or 0 for r in mine),
        "cached_tokens": sum(r.cached_tokens or 0 for r in mine),
        "output_tokens": sum(output_tokens(r) for r in mine if r.ok),
    }


def task_entries(tasks: list[TaskRecord], records: list[RequestRecord]) -> list[dict[str, Any]]:
    """results.json's `tasks`: each raw record with its breakdown."""
    return [{**t.to_dict(), **task_breakdown(t, records)} for t in tasks]


def _agg(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "total": 0.0}
    xs = np.asarray(values, dtype=float)
    return {"mean": float(xs.mean()), "p50": float(np.median(xs)), "total": float(xs.sum())}


def summarize_agent(entries: list[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    """A run's `agent` block from its task entries (see `task_entries`)."""
    verified = [e for e in entries if e["accepted"] is not None]
    accepted = sum(bool(e["accepted"]) for e in verified)
    return {
        "tasks": len(entries),
        "verified": len(verified),
        "accepted": accepted,
        "acceptance_rate": accepted / len(verified) if verified else None,
        "tasks_per_hour": 3600 * len(entries) / duration_s if duration_s > 0 else None,
        "stops": dict(Counter(e["stop"] for e in entries)),
        **{k: _agg([e[k] for e in entries]) for k in ("task_s", *COMPONENTS, *COUNTS)},
    }
