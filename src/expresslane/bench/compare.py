"""`expresslane bench compare A B`: two results.json side by side, with the ratio B/A.

Runs are paired by label (`c=8` with `c=8`); when the two files share no label and each has
one run, those two are paired. Writes `compare.md` and `compare_cdf.png` (A solid, B dashed),
and for agent runs `compare_task_breakdown.png` (A's and B's bars), next to B's results, or
into `--out`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from expresslane.bench.headline import fmt, headlines
from expresslane.bench.plots import (
    MISSING,
    agent_bars,
    color,
    latency_cdf,
    pyplot,
    task_breakdown,
)
from expresslane.bench.report import load_results

Pair = tuple[str, dict[str, Any], dict[str, Any]]


def pair_runs(a: dict[str, Any], b: dict[str, Any]) -> list[Pair]:
    b_runs = {run["label"]: run for run in b["runs"]}
    pairs = [
        (run["label"], run, b_runs[run["label"]]) for run in a["runs"] if run["label"] in b_runs
    ]
    if not pairs and len(a["runs"]) == 1 and len(b["runs"]) == 1:
        ra, rb = a["runs"][0], b["runs"][0]
        pairs = [(f"{ra['label']} vs {rb['label']}", ra, rb)]
    return pairs


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or a == 0 else b / a


def rows(pair: Pair) -> list[list[str]]:
    _, ra, rb = pair
    out = []
    for h in headlines(ra["summary"], rb["summary"]):
        va, vb = h.value(ra["summary"]), h.value(rb["summary"])
        out.append([h.title, fmt(va, h.digits), fmt(vb, h.digits), fmt(ratio(va, vb), 2)])
    return out


def _where(path: str | Path) -> Path:
    p = Path(path)
    return p if p.is_dir() else p.parent


def _describe(meta: dict[str, Any]) -> str:
    return (
        f"{meta.get('base_url')} model {meta.get('model')}, {meta.get('api')}/"
        f"{meta.get('transport')}, tier {meta.get('tier') or '-'}, {meta.get('workload')}, "
        f"response_format {meta.get('response_format') or '-'}, tool_choice "
        f"{meta.get('tool_choice') or '-'}, {meta.get('started_at')}"
    )


def markdown(
    a: dict[str, Any], b: dict[str, Any], pairs: list[Pair], a_path: str, b_path: str
) -> str:
    lines = [
        "# expresslane bench compare",
        "",
        f"- A: `{a_path}`: {_describe(a['meta'])}",
        f"- B: `{b_path}`: {_describe(b['meta'])}",
    ]
    if not pairs:
        lines += ["", "No runs to pair: the two files share no run label."]
    for pair in pairs:
        lines += ["", f"## {pair[0]}", "", "| metric | A | B | B/A |", "|---|---|---|---|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows(pair)]
    return "\n".join(lines) + "\n"


def compare(
    a_path: str, b_path: str, out: str | None = None, console: Console | None = None
) -> int:
    console = console or Console()
    a, b = load_results(a_path), load_results(b_path)
    pairs = pair_runs(a, b)
    for pair in pairs:
        table = Table(title=f"{pair[0]}: A = {a_path}, B = {b_path}")
        for name, justify in (("metric", "left"), ("A", "right"), ("B", "right"), ("B/A", "right")):
            table.add_column(name, justify=justify)
        for row in rows(pair):
            table.add_row(*row)
        console.print(table)
    if not pairs:
        console.print("[yellow]No runs to pair: the two files share no run label.[/]")
    out_dir = Path(out) if out else _where(b_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "compare.md"
    md.write_text(markdown(a, b, pairs, a_path, b_path))
    written = [md]
    plt = pyplot()
    if plt is None:
        console.print(MISSING)
    elif pairs:
        curves = []
        for i, (label, ra, rb) in enumerate(pairs):
            curves.append((f"A {label}", ra, {"color": color(plt, i)}))
            curves.append((f"B {label}", rb, {"color": color(plt, i), "linestyle": "--"}))
        written.append(latency_cdf(plt, curves, out_dir / "compare_cdf.png"))
        bars = agent_bars(a, "A ") + agent_bars(b, "B ")
        breakdown = task_breakdown(plt, bars, out_dir / "compare_task_breakdown.png")
        if breakdown is not None:
            written.append(breakdown)
    console.print("wrote " + ", ".join(str(p) for p in written))
    return 0 if pairs else 1
