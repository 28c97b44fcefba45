"""The benchmark's files: `results.json` (everything, raw records included) and `report.md`.

`results.json` schema (version 1); times in seconds, throughputs per second:

    {"schema_version": 1,
     "meta": {"base_url", "model", "api": "chat"|"responses", "transport": "http"|"websocket",
              "workload", "tier", "seed", "started_at" (ISO 8601 UTC), "expresslane_version",
              "command", "requests", "duration_s", "slo",
              "response_format": null|"json_object"|"json_schema",
              "tool_choice": null|"auto"|"required"|"named" (agent: how forced turns are sent),
              "promises": {TIER: the promise published at /v1/tiers}},
     "runs": [{"label": "c=8" | "rate=2",
               "concurrency": 8 | "rate": 2.0,
               "started_at": ISO 8601,
               "summary": {"requests", "completed", "errors", "error_messages", "retries",
                           "duration_s", "input_tokens", "cached_tokens", "output_tokens",
                           "request_throughput", "output_throughput", "total_token_throughput",
                           "slo", "goodput", "slo_attainment",
                           "ttft", "tpot", "itl", "e2e", "queue", "per_request_tokens_per_s":
                               {"count", "mean", "min", "p50", "p90", "p99", "max"},
                           "tiers": {TIER: {"requests", "ttft", "e2e",
                                            "per_request_tokens_per_s"}},
                           "pools": {POOL/TIER: same as tiers} (a fleet: from the
                               x-expresslane-pool header),
                           "promises" (tiers with a promise published at /v1/tiers):
                               {TIER: {"promised_tokens_per_s", "floor_tokens_per_s",
                                       "promised_ttft_s", "delivered_tokens_per_s", "ttft",
                                       "requests", "kept", "attainment"}},
                           "agent" (agent workload only): {"tasks", "verified", "accepted",
                               "acceptance_rate", "tasks_per_hour", "stops": {STOP: n},
                               "task_s", "queue_prompt_s", "generation_s", "tool_s",
                               "verification_s", "client_overhead_s", "turns", "tool_calls",
                               "input_tokens", "cached_tokens", "output_tokens":
                                   {"mean", "p50", "total"}},
                           "checks" (requests with an output format or tool_choice only):
                               {"schemas_checked", "formats": {FORMAT: COUNTS},
                                "tool_choice": {CHOICE: COUNTS}, "structured": COUNTS,
                                "forced": COUNTS + {"tool_call_rate"}}
                               where COUNTS = {"requests", "parsed" (formats) | "tool_calls"
                               (tools), "valid", "length", "valid_rate"}},
               "records": [RequestRecord.to_dict(), ...],
               "tasks" (agent workload only): [TaskRecord.to_dict() + {"task_s",
                   "queue_prompt_s", "generation_s", "tool_s", "verification_s",
                   "client_overhead_s", "turns", "input_tokens", "cached_tokens",
                   "output_tokens"}, ...]}]}

Metric definitions: `metrics.DEFINITIONS`, `agent_metrics.AGENT_DEFINITIONS` and
`checks.CHECK_DEFINITIONS` (also at the end of report.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from expresslane.bench.agent_metrics import (
    AGENT_DEFINITIONS,
    COMPONENTS,
    TITLES,
    summarize_agent,
    task_entries,
)
from expresslane.bench.checks import CHECK_DEFINITIONS, check_lines, summarize_checks
from expresslane.bench.headline import HEADLINES, fmt
from expresslane.bench.metrics import DEFINITIONS, summarize
from expresslane.bench.promises import judge_tiers
from expresslane.bench.runner import RunResult

SCHEMA_VERSION = 1
RESULTS = "results.json"
STAT_ROWS = (
    ("TTFT", "ttft", 1000, "ms"),
    ("TPOT", "tpot", 1000, "ms"),
    ("ITL", "itl", 1000, "ms"),
    ("E2E", "e2e", 1000, "ms"),
    ("Queue (client)", "queue", 1000, "ms"),
    ("Per-request tokens/s", "per_request_tokens_per_s", 1, "tok/s"),
)


def run_entry(
    result: RunResult, slo: dict[str, float] | None, promises: dict | None = None
) -> dict[str, Any]:
    level = result.level
    entry: dict[str, Any] = {"label": level.label}
    if level.concurrency is not None:
        entry["concurrency"] = level.concurrency
    else:
        entry["rate"] = level.rate
    entry["started_at"] = result.started_at
    entry["summary"] = summarize(result.records, result.duration_s, slo)
    checks = summarize_checks(result.records)
    if checks:
        entry["summary"]["checks"] = checks
    if promises:
        entry["summary"]["promises"] = judge_tiers(result.records, promises)
    entry["records"] = [r.to_dict() for r in result.records]
    if result.tasks:
        entry["tasks"] = task_entries(result.tasks, result.records)
        entry["summary"]["agent"] = summarize_agent(entry["tasks"], result.duration_s)
    return entry


def build_results(
    meta: dict[str, Any], results: list[RunResult], slo: dict[str, float] | None
) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "meta": meta,
        "runs": [run_entry(r, slo, meta.get("promises")) for r in results],
    }


def load_results(path: str | Path) -> dict[str, Any]:
    """A results.json, given as the file or the directory holding it."""
    p = Path(path)
    if p.is_dir():
        p = p / RESULTS
    data = json.loads(p.read_text())
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{p}: unsupported schema_version {data.get('schema_version')!r}")
    return data


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def markdown(data: dict[str, Any]) -> str:
    meta = data["meta"]
    lines = [
        "# expresslane bench report",
        "",
        f"- target: `{meta.get('base_url')}`, model `{meta.get('model')}`, api "
        f"`{meta.get('api')}` over {meta.get('transport')}, tier `{meta.get('tier') or '-'}`",
        f"- workload: `{meta.get('workload')}`, seed {meta.get('seed')}, started "
        f"{meta.get('started_at')}, expresslane {meta.get('expresslane_version')}",
        f"- requests: response_format `{meta.get('response_format') or '-'}`, tool_choice "
        f"`{meta.get('tool_choice') or '-'}`",
        f"- command: `{meta.get('command')}`",
        "",
        "## Summary",
        "",
    ]
    header = ["run"] + [h.title for h in HEADLINES]
    rows = [[run["label"]] + [h.format(run["summary"]) for h in HEADLINES] for run in data["runs"]]
    lines += _table(header, rows)
    for run in data["runs"]:
        lines += run_section(run)
    lines += ["", "## Metric definitions", "", DEFINITIONS]
    if any(run["summary"].get("agent") for run in data["runs"]):
        lines += [AGENT_DEFINITIONS]
    if any(run["summary"].get("checks") for run in data["runs"]):
        lines += [CHECK_DEFINITIONS]
    return "\n".join(lines)


def run_section(run: dict[str, Any]) -> list[str]:
    """One run's part of report.md: its latency table, SLOs, tiers, checks and errors."""
    s = run["summary"]
    lines = [
        "",
        f"## {run['label']}",
        "",
        f"{s['completed']} of {s['requests']} requests completed in {s['duration_s']:.2f} s "
        f"({s['errors']} errors, {s['retries']} retries); {s['input_tokens']} input tokens "
        f"({s['cached_tokens']} cached), {s['output_tokens']} output tokens.",
        "",
    ]
    stat_rows = []
    for title, key, scale, unit in STAT_ROWS:
        st = s[key]
        cells = [
            st[k] * scale if st[k] is not None else None for k in ("mean", "p50", "p90", "p99")
        ]
        stat_rows.append([f"{title} ({unit})"] + [fmt(c, 2) for c in cells] + [str(st["count"])])
    lines += _table(["metric", "mean", "p50", "p90", "p99", "samples"], stat_rows)
    if s.get("slo"):
        slo = ", ".join(f"{k} ≤ {v:g} s" for k, v in s["slo"].items())
        att = s["slo_attainment"]
        lines += [
            "",
            f"Goodput ({slo}): {fmt(s['goodput'], 2)} req/s, "
            f"SLO attainment {fmt(None if att is None else 100 * att, 1)}%.",
        ]
    for group, title in (("tiers", "served tier"), ("pools", "fleet pool/tier")):
        if s.get(group):
            rows = [
                [
                    name,
                    str(t["requests"]),
                    fmt(_ms(t["ttft"]["p50"])),
                    fmt(t["per_request_tokens_per_s"]["p50"]),
                ]
                for name, t in s[group].items()
            ]
            lines += [""] + _table([title, "requests", "TTFT p50 ms", "tok/s p50"], rows)
    if s.get("promises"):
        lines += [""] + promise_lines(s["promises"])
    if s.get("checks"):
        lines += [""] + check_lines(s["checks"])
    if s["error_messages"]:
        lines += ["", "Errors:"] + [f"- {n}× {msg}" for msg, n in s["error_messages"].items()]
    if s.get("agent"):
        lines += agent_section(s["agent"])
    return lines


def promise_lines(promises: dict[str, Any]) -> list[str]:
    """Each tier's published promise against what this client measured."""
    rows = [
        [
            tier,
            fmt(p["promised_tokens_per_s"]),
            fmt(p["delivered_tokens_per_s"]["p50"]),
            fmt(p["floor_tokens_per_s"]),
            fmt(p["promised_ttft_s"] * 1000),
            fmt(_ms(p["ttft"]["p50"])),
            f"{p['kept']}/{p['requests']}",
            fmt(100 * p["attainment"], 1),
        ]
        for tier, p in promises.items()
    ]
    header = [
        "tier",
        "promised tok/s (p50)",
        "delivered tok/s p50",
        "floor tok/s",
        "promised TTFT ms",
        "TTFT p50 ms",
        "kept",
        "attainment %",
    ]
    return ["Promises (published at /v1/tiers; judged here, client-side):", ""] + _table(
        header, rows
    )


def agent_section(a: dict[str, Any]) -> list[str]:
    """Where the run's agent tasks spent their time."""
    rate = a["acceptance_rate"]
    stops = ", ".join(f"{stop} {n}" for stop, n in sorted(a["stops"].items()))
    lines = [
        "",
        f"Agent tasks: {a['tasks']} ({stops}); accepted {a['accepted']} of {a['verified']} "
        f"verified ({fmt(None if rate is None else 100 * rate, 1)}%); "
        f"{fmt(a['tasks_per_hour'], 1)} tasks/h; median {fmt(a['turns']['p50'], 1)} turns, "
        f"{fmt(a['tool_calls']['p50'], 1)} tool calls, {fmt(a['input_tokens']['p50'], 0)} input "
        f"tokens ({fmt(a['cached_tokens']['p50'], 0)} cached) per task.",
        "",
    ]
    total = a["task_s"]["total"]
    rows = []
    for key in ("task_s", *COMPONENTS):
        st = a[key]
        share = 100 * st["total"] / total if total else None
        title = TITLES.get(key, "whole task")
        cells = [fmt(st["mean"], 3), fmt(st["p50"], 3), fmt(st["total"], 3), fmt(share, 1)]
        rows.append([title] + cells)
    return lines + _table(["per task (s)", "mean", "p50", "total", "% of time"], rows)


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000 * x


def write_files(out: Path, data: dict[str, Any]) -> list[Path]:
    """results.json and report.md; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    results = out / RESULTS
    results.write_text(json.dumps(data, indent=1))
    report = out / "report.md"
    report.write_text(markdown(data))
    return [results, report]
