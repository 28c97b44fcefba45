"""Tiers side by side: what the ultrafast lane buys one request, and what it costs the others.

One `expresslane serve` process (the demo model unless --model), one client process. Per
start of the server (`--starts`, each calibrating anew):

  solo     `--ultrafast` ultrafast requests one after another on an idle server: their speed
           alone (also after phase B; the median of both, so the machine's drift between the
           phases cancels)
  phase A  `--streams` default-tier streams of long outputs (each restarts when it ends) for
           `--window` seconds: default throughput without ultrafast
  phase B  the same streams, plus the ultrafast requests again one after another

Per ultrafast request: decode tokens/s (first token excluded) and its inter-token latencies; the
default streams' tokens over the same interval. Reported: the median ultrafast tokens/s over
the median default stream's tokens/s during all ultrafast requests together, the ultrafast
speed in phase B as a fraction of its solo speed, the p99 ITL, default-lane throughput with
and without the ultrafast traffic (the price of the lane), and the spread of the auto targets
over the starts. `--targets` reruns phase B with other ultrafast targets (tokens/s) to show
default throughput against the target.
Token times are client-side, from SSE chunks (`logprobs` gives the tokens in each chunk).

    python benchmarks/tiers.py [--starts 3] [--streams 32] [--ultrafast 10] [--targets 60,90]
    python benchmarks/tiers.py --calibration-only --starts 8    # the auto targets' spread alone
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from common import event_tokens, machine, save_results, stream_body


class Server:
    def __init__(self, args, port: int, lane_flags: list[str]):
        cmd = [sys.executable, "-m", "expresslane.cli", "serve", "--port", str(port)]
        if args.model:
            cmd += ["--model", args.model]
        for flag in lane_flags:
            cmd += ["--lane", flag]
        env = {**os.environ, "EXPRESSLANE_ACCOUNTS": ":memory:", "EXPRESSLANE_STORE": ":memory:"}
        env["EXPRESSLANE_CALIBRATION_CACHE"] = "off"  # each start measures: the targets' spread
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.url = f"http://127.0.0.1:{port}"

    async def ready(self, http: httpx.AsyncClient) -> dict:
        for _ in range(600):
            try:
                if (await http.get(self.url + "/health")).status_code == 200:
                    text = (await http.get(self.url + "/metrics")).text
                    if "lane_target_tokens_per_second{" in text:  # calibrated
                        models = (await http.get(self.url + "/v1/models")).json()
                        self.model = models["data"][0]["id"]
                        return _targets(text)
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.5)
        raise RuntimeError("the server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _targets(metrics: str) -> dict[str, float]:
    out = {}
    for line in metrics.splitlines():
        if line.startswith("expresslane:lane_target_tokens_per_second{"):
            tier = line.split('tier="')[1].split('"')[0]
            out[tier] = float(line.rsplit(" ", 1)[1])
    return out


async def stream(http, server, tier: str, max_tokens: int, stamps: list[float]) -> None:
    """One streamed completion; appends a timestamp per received token to `stamps`."""
    body = stream_body(server.model, tier, max_tokens)
    async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                stamps.extend([time.perf_counter()] * event_tokens(line[6:]))


async def default_worker(http, server, args, stamps: list[float], stop: asyncio.Event):
    while not stop.is_set():
        await stream(http, server, "default", args.default_tokens, stamps)


def count_between(stamps: list[float], start: float, end: float) -> int:
    return sum(start <= t <= end for t in stamps)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def ultrafast_request(stamps: list[float]) -> dict:
    first, last = stamps[0], stamps[-1]
    return {
        "tokens_per_s": (len(stamps) - 1) / (last - first),
        "itl": [b - a for a, b in zip(stamps, stamps[1:])],
        "first": first,
        "last": last,
    }


async def solo_speeds(args, server: Server, http) -> list[float]:
    """Tokens/s of the ultrafast requests alone on the server (after one unmeasured warm-up
    request)."""
    await stream(http, server, "ultrafast", args.ultrafast_tokens, [])
    speeds = []
    for _ in range(args.ultrafast):
        stamps: list[float] = []
        await stream(http, server, "ultrafast", args.ultrafast_tokens, stamps)
        speeds.append(ultrafast_request(stamps)["tokens_per_s"])
    return speeds


async def run_phases(args, server: Server, http) -> dict:
    per_stream: list[list[float]] = [[] for _ in range(args.streams)]
    stop = asyncio.Event()
    workers = [asyncio.create_task(default_worker(http, server, args, s, stop)) for s in per_stream]
    await asyncio.sleep(args.warmup)
    a0 = time.perf_counter()
    await asyncio.sleep(args.window)
    a1 = time.perf_counter()
    alone = [count_between(s, a0, a1) / (a1 - a0) for s in per_stream]
    fast = []
    for _ in range(args.ultrafast):
        stamps: list[float] = []
        await stream(http, server, "ultrafast", args.ultrafast_tokens, stamps)
        f = ultrafast_request(stamps)
        first, last = f.pop("first"), f.pop("last")
        counts = [count_between(s, first, last) for s in per_stream]
        f["default_stream_tokens"] = counts
        f["default_throughput"] = sum(counts) / (last - first)
        f["seconds"] = last - first
        fast.append(f)
        await asyncio.sleep(0.2)  # let the default lane run uncapped for a moment
    stop.set()
    for w in workers:
        w.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    itl = [x for f in fast for x in f["itl"]]
    busy = sum(f["seconds"] for f in fast)
    # each default stream's speed over all ultrafast requests together (one request is too
    # short for a stream that gets a few tokens a second to show a speed)
    stream_speed = statistics.median(
        sum(f["default_stream_tokens"][i] for f in fast) / busy for i in range(args.streams)
    )
    ultrafast_speed = statistics.median(f["tokens_per_s"] for f in fast)
    return {
        "default_alone": {
            "throughput": sum(alone),
            "stream_tokens_per_s_median": statistics.median(alone),
        },
        "with_ultrafast": {
            "ultrafast_tokens_per_s_median": ultrafast_speed,
            "default_stream_tokens_per_s_median": stream_speed,
            # None when the default streams got no token at all during ultrafast requests
            "ratio_median": ultrafast_speed / stream_speed if stream_speed else None,
            "itl_p50_ms": 1000 * percentile(itl, 50),
            "itl_p99_ms": 1000 * percentile(itl, 99),
            "default_throughput": sum(f["default_throughput"] * f["seconds"] for f in fast) / busy,
        },
        "ultrafast_requests": fast,
    }


async def one_start(args, http, port: int, target: float | None) -> dict:
    flags = [] if target is None else [f"ultrafast.target_tokens_per_s={target}"]
    server = Server(args, port, flags)
    try:
        lane_targets = await server.ready(http)
        if args.calibration_only:
            return {"ultrafast_target_tokens_per_s": lane_targets["ultrafast"]}
        speeds = await solo_speeds(args, server, http)
        run = await run_phases(args, server, http)
        await asyncio.sleep(1.0)  # the cancelled default streams are aborted
        speeds += await solo_speeds(args, server, http)
    finally:
        server.stop()
    solo = {"ultrafast_tokens_per_s_median": statistics.median(speeds), "per_request": speeds}
    run["solo"] = solo
    b = run["with_ultrafast"]
    b["fraction_of_solo"] = (
        b["ultrafast_tokens_per_s_median"] / solo["ultrafast_tokens_per_s_median"]
    )
    run["ultrafast_target_tokens_per_s"] = lane_targets["ultrafast"]
    run["target_itl_ms"] = 1000 / lane_targets["ultrafast"]
    return run


async def main_async(args) -> dict:
    results = {"machine": machine(), "settings": vars(args), "runs": []}
    targets = [None] * args.starts + [float(t) for t in args.targets.split(",") if t]
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=200)) as http:
        for i, target in enumerate(targets):
            run = await one_start(args, http, args.port + i, target)
            results["runs"].append(run)
            if args.calibration_only:
                print(f"start {i + 1}: target {run['ultrafast_target_tokens_per_s']:.0f} tok/s")
            else:
                report(run)
    auto = [r["ultrafast_target_tokens_per_s"] for r in results["runs"][: args.starts]]
    mid = statistics.median(auto)
    results["auto_targets"] = {"values": auto, "spread": [t / mid - 1 for t in auto]}
    spread = ", ".join(f"{100 * s:+.0f}%" for s in results["auto_targets"]["spread"])
    print(
        f"auto targets over {args.starts} starts: {', '.join(f'{t:.0f}' for t in auto)} tok/s "
        f"({spread} of their median)"
    )
    return results


def report(run: dict) -> None:
    a, b = run["default_alone"], run["with_ultrafast"]
    print(
        f"target {run['ultrafast_target_tokens_per_s']:.0f} tok/s "
        f"(ITL {run['target_itl_ms']:.1f} ms) | ultrafast solo "
        f"{run['solo']['ultrafast_tokens_per_s_median']:.1f}, with default "
        f"{b['ultrafast_tokens_per_s_median']:.1f} tok/s ({100 * b['fraction_of_solo']:.0f}% of "
        f"solo) vs default stream {b['default_stream_tokens_per_s_median']:.1f} -> "
        f"{b['ratio_median'] or float('inf'):.1f}x | ITL p50 {b['itl_p50_ms']:.1f} ms "
        f"p99 {b['itl_p99_ms']:.1f} ms"
        f" | default throughput {a['throughput']:.0f} alone, {b['default_throughput']:.0f} "
        f"with ultrafast",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--starts", type=int, default=3, help="server starts with the auto target")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--default-tokens", type=int, default=512)
    ap.add_argument("--ultrafast", type=int, default=10)
    ap.add_argument("--ultrafast-tokens", type=int, default=128)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--targets", default="", help="more ultrafast targets (tokens/s) to run")
    ap.add_argument("--port", type=int, default=8731)
    ap.add_argument(
        "--calibration-only", action="store_true", help="only start and read the auto targets"
    )
    args = ap.parse_args()
    if args.calibration_only:
        args.targets = ""
    results = asyncio.run(main_async(args))
    path = save_results("tiers", results)
    print(f"results: {Path(path)}")


if __name__ == "__main__":
    main()
