"""`expresslane bench` (run a benchmark) and `expresslane bench compare A B`.

The run's options are `bench`'s own and `compare` an optional sub-command (`bench --base-url URL`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expresslane import __version__

# The run's modules (httpx, numpy, rich) load inside the commands: `expresslane --help`
# builds this parser and should not wait for them.
if TYPE_CHECKING:
    from rich.table import Table

    from expresslane.bench.runner import Level
    from expresslane.bench.target import Target
    from expresslane.bench.workloads import Workload, WorkloadOptions

EXAMPLES = """\
examples:
  expresslane bench --base-url http://127.0.0.1:8000 --concurrency 1,8,32 --requests 200
  expresslane bench --base-url http://127.0.0.1:8000 --rate 2,4 --duration 60 --tier ultrafast \\
      --slo ttft=0.5,tpot=0.05
  expresslane bench --base-url URL --workload replay:trace.jsonl --transport websocket
  expresslane bench --base-url URL --workload agent --concurrency 1,6
  expresslane bench --base-url URL --workload agent:60 --tool-time lognormal:0.5,0.8
  expresslane bench --base-url URL --response-format json_schema --concurrency 1,8
  expresslane bench --base-url URL --tool-choice named --api responses
  expresslane bench compare bench-results/before bench-results/after
"""

# (flag, attribute) pairs written back into the recorded command, in this order.
RECORDED = (
    ("--base-url", "base_url"),
    ("--model", "model"),
    ("--api", "api"),
    ("--transport", "transport"),
    ("--workload", "workload"),
    ("--tier", "tier"),
    ("--concurrency", "concurrency"),
    ("--rate", "rate"),
    ("--requests", "requests"),
    ("--duration", "duration"),
    ("--input-tokens", "input_tokens"),
    ("--output-tokens", "output_tokens"),
    ("--prefix-tokens", "prefix_tokens"),
    ("--agent-max-turns", "agent_max_turns"),
    ("--tool-time", "tool_time"),
    ("--response-format", "response_format"),
    ("--tool-choice", "tool_choice"),
    ("--seed", "seed"),
    ("--slo", "slo"),
    ("--warmup", "warmup"),
    ("--max-retries", "max_retries"),
    ("--timeout", "timeout"),
    ("--extra-body", "extra_body"),
    ("--out", "out"),
)


def add_bench_command(sub: Any) -> None:
    b = sub.add_parser(
        "bench",
        help="benchmark any OpenAI-compatible endpoint (or `bench compare A B`)",
        description="Load-test an OpenAI-compatible endpoint and write results.json, report.md "
        "and plots. Metric definitions are at the end of report.md.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("--base-url", help="the endpoint, e.g. http://127.0.0.1:8000 (/v1 optional)")
    b.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    b.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (never recorded)")
    b.add_argument(
        "--api",
        choices=("responses", "chat"),
        default=None,
        help="API to call (default: chat; responses with --transport websocket)",
    )
    b.add_argument(
        "--transport",
        choices=("http", "websocket"),
        default="http",
        help="websocket: the Responses API WebSocket mode, one socket per session",
    )
    b.add_argument(
        "--workload",
        default="synthetic",
        help="synthetic (default), replay:FILE, or agent[:N] (a coding agent fixing N bundled "
        "tasks per run, default each once; see report.md for its time split)",
    )
    b.add_argument("--tier", help="service_tier to request (default: none sent)")
    _load_flags(b)
    _workload_flags(b)
    b.add_argument(
        "--extra-body",
        default=None,
        help="JSON merged into every request body, e.g. '{\"temperature\": 0}'",
    )
    b.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    b.add_argument("--slo", default=None, help="goodput SLOs in seconds: ttft=0.5,tpot=0.05,e2e=10")
    b.add_argument("--warmup", type=int, default=1, help="unrecorded requests before the runs")
    b.add_argument("--max-retries", type=int, default=3, help="retries on 408/409/429/5xx")
    b.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    b.add_argument("--out", default=None, help="output directory (default: bench-results/TIME)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_bench)
    compare_sub = b.add_subparsers(
        dest="bench_command", title="optional sub-command", metavar="compare"
    )
    c = compare_sub.add_parser("compare", help="compare two results.json (files or directories)")
    c.add_argument("a", help="baseline results.json or its directory")
    c.add_argument("b", help="results.json or its directory to compare with A")
    c.add_argument("--out", default=None, help="where compare.md/png go (default: next to B)")
    c.set_defaults(func=cmd_compare)


def _load_flags(b: argparse.ArgumentParser) -> None:
    load = b.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency", help="closed loop: comma-separated levels, one run each (default 1)"
    )
    load.add_argument(
        "--rate",
        help="open loop: Poisson arrivals, requests/s; comma-separated "
        "levels, one run each ('inf': all at once)",
    )
    stop = b.add_mutually_exclusive_group()
    stop.add_argument(
        "--requests",
        type=int,
        help="requests per run (default: the workload's: 100 for synthetic, one pass for "
        "replay; agent: no cap, a run ends when its tasks are done)",
    )
    stop.add_argument("--duration", type=float, help="seconds per run (in-flight ones finish)")


def _workload_flags(b: argparse.ArgumentParser) -> None:
    b.add_argument("--input-tokens", type=int, default=256, help="synthetic prompt words")
    b.add_argument(
        "--output-tokens",
        type=int,
        help="max output tokens per request (default 128; agent 1024; 256 with "
        "--response-format or --tool-choice)",
    )
    b.add_argument("--prefix-tokens", type=int, default=0, help="synthetic shared-prefix words")
    b.add_argument("--agent-max-turns", type=int, default=6, help="agent: most requests per task")
    b.add_argument(
        "--tool-time",
        default=None,
        help="agent: simulate tools, each call sleeping a seeded delay (seconds) from const:S, "
        "uniform:A,B, exp:MEAN or lognormal:MEDIAN,SIGMA and returning a canned result "
        "(nothing runs, so tasks are not verified)",
    )
    b.add_argument(
        "--response-format",
        choices=("json_object", "json_schema"),
        default=None,
        help="synthetic: ask for the findings of a review as a JSON object, or as JSON of a "
        "fixed schema (Chat response_format, Responses text.format); report.md counts the "
        "outputs that parse and validate (default --output-tokens 256)",
    )
    b.add_argument(
        "--tool-choice",
        choices=("auto", "required", "named"),
        default=None,
        help="synthetic: declare two tools and send this tool_choice (named: the tool the "
        "prompt asks for); report.md counts the replies with a valid tool call (default "
        "--output-tokens 256). agent: how turns that need a tool are sent (default required; "
        "named: the one next tool where there is one; auto: never forced)",
    )
    b.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="don't send ignore_eos with synthetic requests (for endpoints without it)",
    )


def cmd_compare(args: argparse.Namespace) -> int:
    from expresslane.bench.compare import compare

    try:
        return compare(args.a, args.b, args.out)
    except (OSError, ValueError) as e:
        print(f"expresslane bench compare: {e}", file=sys.stderr)
        return 2


def _levels(args: argparse.Namespace) -> list[Level]:
    from expresslane.bench.runner import Level

    try:
        if args.rate:
            levels = [Level(rate=float(x)) for x in args.rate.split(",")]
            bad = [lv for lv in levels if not lv.rate or lv.rate <= 0]
        else:
            levels = [Level(concurrency=int(x)) for x in (args.concurrency or "1").split(",")]
            bad = [lv for lv in levels if lv.concurrency is None or lv.concurrency < 1]
    except ValueError as e:
        raise SystemExit(f"expresslane bench: --concurrency/--rate: {e}") from e
    if bad:
        raise SystemExit("expresslane bench: concurrency and rate levels must be positive")
    return levels


def first_model(target: Target) -> str:
    """The first model id of GET /v1/models."""
    import httpx

    r = httpx.get(target.url("models"), headers=target.headers(), timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def recorded_command(args: argparse.Namespace) -> str:
    parts = ["expresslane", "bench"]
    for flag, attr in RECORDED:
        value = getattr(args, attr, None)
        if value is not None:
            parts += [flag, str(value)]
    if args.api_key:
        parts += ["--api-key", "***"]
    if args.no_ignore_eos:
        parts.append("--no-ignore-eos")
    return shlex.join(parts)


def summary_table(data: dict[str, Any]) -> Table:
    from rich.table import Table

    from expresslane.bench.headline import headlines

    table = Table(title="expresslane bench")
    table.add_column("metric")
    for run in data["runs"]:
        table.add_column(run["label"], justify="right")
    for h in headlines(*(run["summary"] for run in data["runs"])):
        table.add_row(h.title, *(h.format(run["summary"]) for run in data["runs"]))
    return table


def _target(args: argparse.Namespace) -> Target:
    import httpx

    from expresslane.bench.target import Target

    try:
        extra_body = json.loads(args.extra_body) if args.extra_body else {}
    except ValueError as e:
        raise SystemExit(f"expresslane bench: --extra-body is not JSON: {e}") from e
    if not isinstance(extra_body, dict):
        raise SystemExit("expresslane bench: --extra-body must be a JSON object")
    target = Target(
        base_url=args.base_url,
        model=args.model,
        api=args.api,
        transport=args.transport,
        api_key=args.api_key,
        tier=args.tier,
        max_retries=args.max_retries,
        timeout_s=args.timeout,
        extra_body=extra_body,
    )
    if target.model is None:
        try:
            target.model = args.model = first_model(target)
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise SystemExit(f"expresslane bench: no --model and GET /v1/models failed: {e}") from e
    return target


def make_workload(spec: str, options: WorkloadOptions) -> Workload:
    """'synthetic', 'replay:FILE' or 'agent[:N]' -> a workload."""
    # Importing the modules registers the built-in workloads.
    from expresslane.bench import agent, replay, synthetic  # noqa: F401
    from expresslane.bench.workloads import WORKLOADS

    name, _, arg = spec.partition(":")
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}")
    return WORKLOADS[name](arg or None, options)


def _workload(args: argparse.Namespace) -> Workload:
    from expresslane.bench.workloads import WorkloadOptions

    options = WorkloadOptions(
        seed=args.seed,
        input_tokens=args.input_tokens,
        output_tokens=args.output_tokens,
        prefix_tokens=args.prefix_tokens,
        ignore_eos=not args.no_ignore_eos,
        agent_max_turns=6 if args.agent_max_turns is None else args.agent_max_turns,
        tool_time=args.tool_time,
        response_format=args.response_format,
        tool_choice=args.tool_choice,
    )
    try:
        workload = make_workload(args.workload, options)
    except (ValueError, OSError) as e:
        raise SystemExit(f"expresslane bench: {e}") from e
    if workload.name == "synthetic" and (args.response_format or args.tool_choice):
        from expresslane.bench.checks import have_jsonschema

        if not have_jsonschema():  # fail before the run, not after it
            raise SystemExit(
                "expresslane bench: --response-format and --tool-choice check the outputs with "
                "jsonschema: pip install jsonschema (or 'expresslane[bench]')"
            )
    return workload


def cmd_bench(args: argparse.Namespace) -> int:
    from expresslane.bench.metrics import parse_slo
    from expresslane.bench.runner import run_benchmark

    if not args.base_url:
        raise SystemExit("expresslane bench: give --base-url (or use `bench compare A B`)")
    args.api = args.api or ("responses" if args.transport == "websocket" else "chat")
    started_at = datetime.now(timezone.utc)
    args.out = args.out or str(Path("bench-results") / started_at.strftime("%Y%m%d-%H%M%S"))
    try:
        slo = parse_slo(args.slo)
    except ValueError as e:
        raise SystemExit(f"expresslane bench: {e}") from e
    levels = _levels(args)
    workload = _workload(args)
    if args.requests is None and args.duration is None:
        args.requests = workload.default_requests()
    target = _target(args)
    results = asyncio.run(
        run_benchmark(
            target,
            workload,
            levels,
            requests=args.requests,
            duration_s=args.duration,
            seed=args.seed,
            warmup_requests=args.warmup,
            show_progress=not args.quiet and sys.stderr.isatty(),
        )
    )
    return _report(args, target, started_at, slo, results)


AGENT_TOOL_CHOICE = "required"  # the agent's default: `agent.py`


def _is_agent(args: argparse.Namespace) -> bool:
    return args.workload.partition(":")[0] == "agent"


def _report(args, target: Target, started_at: datetime, slo, results) -> int:
    from rich.console import Console

    from expresslane.bench.plots import write_plots
    from expresslane.bench.promises import published
    from expresslane.bench.report import build_results, write_files

    meta = {
        "base_url": args.base_url,
        "model": target.model,
        "api": args.api,
        "transport": args.transport,
        "workload": args.workload,
        "tier": args.tier,
        "seed": args.seed,
        "started_at": started_at.isoformat(timespec="seconds"),
        "expresslane_version": __version__,
        "command": recorded_command(args),
        "requests": args.requests,
        "duration_s": args.duration,
        "slo": slo or None,
        "response_format": args.response_format,
        "tool_choice": args.tool_choice or (AGENT_TOOL_CHOICE if _is_agent(args) else None),
        "promises": published(target),  # each tier's promise, as /v1/tiers publishes it
    }
    data = build_results(meta, results, slo)
    out = Path(args.out)
    written = write_files(out, data)
    plots, skipped = write_plots(out, data)
    written += plots
    console = Console()
    console.print(summary_table(data))
    if skipped:
        console.print(f"[yellow]{skipped}[/]")
    console.print(f"wrote {', '.join(p.name for p in written)} in {out}", soft_wrap=True)
    if not any(run["summary"]["completed"] for run in data["runs"]):
        first = next((r["error"] for run in data["runs"] for r in run["records"]), None)
        print(f"expresslane bench: every request failed (first error: {first})", file=sys.stderr)
        return 1
    return 0
