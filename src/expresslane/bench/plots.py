"""PNG plots of a results.json: latency CDFs, throughput against per-user speed, tiers, and
for the agent workload the split of a task's time (`task_breakdown.png`).

matplotlib is optional (the `bench` extra): without it the plots are skipped with a message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from expresslane.bench import metrics
from expresslane.bench.agent_metrics import COMPONENTS, TITLES
from expresslane.bench.records import RequestRecord

BREAKDOWN = "task_breakdown.png"
MISSING = "plots skipped: matplotlib is not installed (pip install 'expresslane[bench]')"


def pyplot() -> Any | None:
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def records_of(run: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord.from_dict(r) for r in run["records"]]


def cdf_line(ax: Any, values: list[float], **style: Any) -> None:
    xs = np.sort(np.asarray(values, dtype=float))
    if xs.size:
        ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", **style)


def latency_cdf(plt: Any, curves: list[tuple[str, dict[str, Any], dict]], path: Path) -> Path:
    """TTFT and E2E CDFs, one line per (label, run, matplotlib line style)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, run, style in curves:
        ok = [r for r in records_of(run) if r.ok]
        ttfts = [v for r in ok if (v := metrics.ttft(r)) is not None]
        e2es = [v for r in ok if (v := metrics.e2e(r)) is not None]
        cdf_line(axes[0], ttfts, label=label, **style)
        cdf_line(axes[1], e2es, label=label, **style)
    for ax, name in zip(axes, ("TTFT (s)", "E2E latency (s)")):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 1.02)
    if axes[0].get_lines():
        axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput_vs_speed(plt: Any, data: dict[str, Any], path: Path) -> Path:
    """x: median per-request tokens/s, y: output-token throughput; one point per run."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    xs, ys = [], []
    for run in data["runs"]:
        s = run["summary"]
        x, y = s["per_request_tokens_per_s"]["p50"], s["output_throughput"]
        if x is None or y is None:
            continue
        xs.append(x)
        ys.append(y)
        ax.annotate(run["label"], (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.plot(xs, ys, "o-")
    ax.set_xlabel("per-request output tokens/s (median)")
    ax.set_ylabel("output throughput (tokens/s)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def tiers(plt: Any, data: dict[str, Any], path: Path) -> Path | None:
    """Median per-request tokens/s and TTFT per served tier, bars grouped by run."""
    names = sorted({t for run in data["runs"] for t in run["summary"]["tiers"]})
    if not names:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(data["runs"])
    for i, run in enumerate(data["runs"]):
        per_tier = run["summary"]["tiers"]
        x = np.arange(len(names)) + i * width
        speed = [_p50(per_tier, t, "per_request_tokens_per_s", 1) for t in names]
        ttft = [_p50(per_tier, t, "ttft", 1000) for t in names]
        axes[0].bar(x, speed, width, label=run["label"])
        axes[1].bar(x, ttft, width, label=run["label"])
    for ax, name in zip(axes, ("per-request tokens/s (median)", "TTFT ms (median)")):
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _p50(per_tier: dict[str, Any], tier: str, key: str, scale: float) -> float:
    value = per_tier.get(tier, {}).get(key, {}).get("p50")
    return 0.0 if value is None else value * scale


def agent_bars(data: dict[str, Any], prefix: str = "") -> list[tuple[str, dict[str, Any]]]:
    """(bar label, agent summary) for each run of a results.json that has agent tasks."""
    tier = data["meta"].get("tier")
    suffix = f"\ntier {tier}" if tier else ""
    return [
        (prefix + run["label"] + suffix, run["summary"]["agent"])
        for run in data["runs"]
        if run["summary"].get("agent")
    ]


def task_breakdown(plt: Any, bars: list[tuple[str, dict[str, Any]]], path: Path) -> Path | None:
    """One stacked bar per (label, agent summary): the mean seconds per task in each part."""
    if not bars:
        return None
    labels = [label for label, _ in bars]
    fig, ax = plt.subplots(figsize=(4.5 + 1.1 * len(bars), 4.5))
    bottom = np.zeros(len(bars))
    for i, key in enumerate(COMPONENTS):
        means = np.array([agent[key]["mean"] or 0.0 for _, agent in bars])
        # Client overhead can come out a hair below zero from clock rounding.
        means = np.maximum(means, 0.0)
        ax.bar(labels, means, 0.6, bottom=bottom, label=TITLES[key], color=color(plt, i))
        bottom += means
    ax.set_xlim(-0.8, len(bars) - 0.2)
    ax.set_ylabel("mean seconds per task")
    ax.set_title("where an agent task's time goes")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def color(plt: Any, i: int) -> Any:
    return plt.get_cmap("tab10")(i % 10)


def write_plots(out: Path, data: dict[str, Any]) -> tuple[list[Path], str | None]:
    """The report's PNGs; returns their paths and, when plots were skipped, why."""
    plt = pyplot()
    if plt is None:
        return [], MISSING
    curves = [(run["label"], run, {"color": color(plt, i)}) for i, run in enumerate(data["runs"])]
    paths = [
        latency_cdf(plt, curves, out / "latency_cdf.png"),
        throughput_vs_speed(plt, data, out / "throughput_vs_speed.png"),
    ]
    breakdown = task_breakdown(plt, agent_bars(data), out / BREAKDOWN)
    for extra in (tiers(plt, data, out / "tiers.png"), breakdown):
        if extra is not None:
            paths.append(extra)
    return paths, None
