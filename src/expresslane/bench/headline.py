"""The headline numbers of a run, shared by the console table, report.md and compare."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Headline:
    title: str
    path: tuple[str, ...]  # keys into a run's summary
    scale: float = 1.0
    digits: int = 1

    def value(self, summary: dict[str, Any]) -> float | None:
        v: Any = summary
        for key in self.path:
            if not isinstance(v, dict) or v.get(key) is None:
                return None
            v = v[key]
        return float(v) * self.scale

    def format(self, summary: dict[str, Any]) -> str:
        return fmt(self.value(summary), self.digits)


def fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


HEADLINES = (
    Headline("requests", ("requests",), digits=0),
    Headline("errors", ("errors",), digits=0),
    Headline("req/s", ("request_throughput",), digits=2),
    Headline("output tok/s", ("output_throughput",)),
    Headline("goodput req/s", ("goodput",), digits=2),
    Headline("TTFT p50 ms", ("ttft", "p50"), 1000),
    Headline("TTFT p99 ms", ("ttft", "p99"), 1000),
    Headline("TPOT p50 ms", ("tpot", "p50"), 1000, 2),
    Headline("TPOT p99 ms", ("tpot", "p99"), 1000, 2),
    Headline("ITL p50 ms", ("itl", "p50"), 1000, 2),
    Headline("E2E p50 s", ("e2e", "p50"), digits=3),
    Headline("E2E p99 s", ("e2e", "p99"), digits=3),
    Headline("tok/s per request p50", ("per_request_tokens_per_s", "p50")),
)

# Shown as well when a run has agent tasks (summary["agent"]).
AGENT_HEADLINES = (
    Headline("agent tasks", ("agent", "tasks"), digits=0),
    Headline("accepted %", ("agent", "acceptance_rate"), 100),
    Headline("tasks/h", ("agent", "tasks_per_hour")),
    Headline("task s p50", ("agent", "task_s", "p50"), digits=2),
    Headline("queue+prompt s/task", ("agent", "queue_prompt_s", "mean"), digits=2),
    Headline("generation s/task", ("agent", "generation_s", "mean"), digits=2),
    Headline("tools s/task", ("agent", "tool_s", "mean"), digits=2),
    Headline("verification s/task", ("agent", "verification_s", "mean"), digits=2),
    Headline("client s/task", ("agent", "client_overhead_s", "mean"), digits=2),
    Headline("turns/task p50", ("agent", "turns", "p50")),
)


# Shown as well when a run checked structured outputs or forced tool calls (`checks.py`).
CHECK_HEADLINES = (
    Headline("JSON valid %", ("checks", "structured", "valid_rate"), 100),
    Headline("forced: tool call %", ("checks", "forced", "tool_call_rate"), 100),
    Headline("forced: call valid %", ("checks", "forced", "valid_rate"), 100),
)


def headlines(*summaries: dict[str, Any]) -> tuple[Headline, ...]:
    """HEADLINES, plus AGENT_HEADLINES when any of the summaries has agent tasks and the
    CHECK_HEADLINES that any of them has a value for."""
    out = HEADLINES
    if any(s.get("agent") for s in summaries):
        out += AGENT_HEADLINES
    return out + tuple(h for h in CHECK_HEADLINES if any(h.value(s) is not None for s in summaries))
