"""Pools against lanes: does an ultrafast pool keep its speed while the default pool is full,
and what does carrying the fleet's tokens cost?

Setups of the demo model on this machine, one after the other, same client and load:

  lanes  one `expresslane serve` process: ultrafast and default are lanes of one engine
  fleet  `expresslane cluster` on a local Ray cluster: an ultrafast pool and a default pool of
         one replica each, each pinned to its own core (`cpu_affinity`), one ingress. The
         ultrafast pool's core is its own, as its machines would be: Ray, Serve's proxy, the
         ingress and this client run on the remaining cores, which on a 2-core machine is
         the default pool's core (so the default pool also pays for every hop of the
         ultrafast pool's tokens)

`--http direct,serve-proxy` runs today's fleet with its ingress replicas serving HTTP
themselves and behind Ray Serve's HTTP proxy. `--before REV` first runs the fleet of git
revision REV (a worktree of it, imported by a child process and its Ray cluster), so today's
fleet is measured beside an earlier token path in one run. `--runs N` repeats everything N
times. `--intervals` runs each fleet once per pair of the two pools' `stream_interval` (tokens
a replica gathers per stream before a hop). Each setup runs three phases: ultrafast requests
alone (the single-lane speed), `--streams` default streams alone (default throughput) for
`--window` seconds, then both at once, ultrafast requests following each other for as long (a
window of 8 requests, 1-2 s, moved default's kept share by ±20% between runs). Reported per
setup: ultrafast decode tokens/s with default traffic against alone, and default throughput
with ultrafast traffic against alone. Then the fleet's added latency: `--probes` one-token
completions, one at a time on an idle system, through the fleet's ingress and router, taking
turns with the same probes to the lanes server, which stays up through the run (e2e p50 and
p99; the difference is what the ingress, router and token path add), and the CPU time each
part spent per default token while the default streams ran alone (from /proc, Ray's other
processes also by name); "transport" is the ingress's, Serve's proxy's and Ray's other
processes' together.

    python benchmarks/fleet.py [--streams 16] [--ultrafast 8] [--probes 50] [--intervals 1:1,8:4]
    python benchmarks/fleet.py --before eadec6b --http direct,serve-proxy --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
from common import event_tokens, machine, process_cpu_seconds, save_results, stream_body
from tiers import Server, count_between, percentile, stream


def cores() -> tuple[list[int], list[int], list[int]]:
    """(ultrafast pool's, default pool's, everything else's) cores."""
    mine = sorted(os.sched_getaffinity(0))
    fast, std, rest = mine[:1], mine[1:2] or mine[:1], mine[2:]
    return fast, std, rest or std


@dataclass
class Lanes:
    """The lanes server, as a fleet's child process reaches it for the probes."""

    url: str
    model: str


class Fleet:
    def __init__(self, port: int, intervals: tuple[int, int] = (1, 1), http: str | None = None):
        from expresslane.fleet.cluster_file import parse_cluster
        from expresslane.fleet.deploy import deploy

        fast, std, shared = cores()
        os.sched_setaffinity(0, shared)  # Ray's processes, started below, inherit it

        engine = {"seed": 0}
        spec = parse_cluster(
            {
                # (the key is left out for code from before it existed: `--before`)
                "ingress": {"port": port, "num_cpus": 0.1, **({"http": http} if http else {})},
                "server": {"store_path": ":memory:", "accounts_path": ":memory:"},
                "pools": {
                    "fast": {
                        "tiers": ["ultrafast"],
                        "num_cpus": 1,
                        "cpu_affinity": fast,
                        "stream_interval": intervals[0],
                        "engine": {**engine, "max_batch": 4},
                    },
                    "std": {
                        "tiers": ["default"],
                        "num_cpus": 1,
                        "cpu_affinity": std,
                        "stream_interval": intervals[1],
                        "engine": engine,
                    },
                },
            }
        )
        self.url = deploy(spec, num_cpus=4)
        self.model = "expresslane-demo"

    def stop(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


async def lean_stream(session, server, tier: str, max_tokens: int, stamps: list[float]) -> None:
    """`tiers.stream` on aiohttp, whose C parser costs this client less than half of httpx's
    CPU per token (0.033 against 0.075 ms): on two cores the client shares the default pool's."""
    body = stream_body(server.model, tier, max_tokens)
    async with session.post(server.url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: {"):
                stamps.extend([time.perf_counter()] * event_tokens(line[6:]))


async def ultrafast_requests(http, server, args, results: list, seconds: float = 0.0) -> None:
    """`--ultrafast` requests one after the other, and more until `seconds` have passed."""
    start = time.perf_counter()
    while len(results) < args.ultrafast or time.perf_counter() - start < seconds:
        stamps: list[float] = []
        await lean_stream(http, server, "ultrafast", args.ultrafast_tokens, stamps)
        span = stamps[-1] - stamps[0]  # 0 where all its tokens came in one read (a stall)
        speed = (len(stamps) - 1) / span if span > 0 else math.inf  # (medians are taken)
        results.append((speed, stamps[0], stamps[-1]))


TRANSPORT = ("ingress", "Serve proxy", "Ray (other)")
PARTS = {  # a process's command line -> the part of the fleet it is
    "ServeReplica:expresslane:ingress": "ingress",
    "ProxyActor": "Serve proxy",
    "pool-std": "default pool replica",
    "pool-fast": "ultrafast pool replica",
}


def part_of(pid: int, cmd: str) -> str | None:
    """The part of the fleet a process is (None: not the fleet's, nor this client)."""
    if pid == os.getpid():
        return "client"
    if "ray" not in cmd:
        return None
    return next((v for k, v in PARTS.items() if k in cmd), "Ray (other)")


def process_name(cmd: str) -> str:
    """A Ray process's title, its program's file name, or a Python program's script's."""
    words = cmd.split() or ["?"]
    if words[0].startswith("ray::"):
        return words[0]
    program = Path(words[0]).name
    if not program.startswith("python"):
        return program
    return next((Path(w).name for w in words[1:] if w.endswith(".py")), program)


def cpu_ms_per_token(before: dict, after: dict, tokens: int) -> tuple[dict, dict]:
    """CPU ms per token between two `process_cpu_seconds` readings: by part, and Ray's other
    processes by name. Per process: one that started in between counts whole, one that ended
    is left out (summed by part first, a process ending in the window took all it had ever
    used off its part)."""
    parts: dict[str, float] = {}
    other: dict[str, float] = {}
    for pid, (cmd, seconds) in after.items():
        part = part_of(pid, cmd)
        if part is None:
            continue
        ms = 1000 * (seconds - before.get(pid, (cmd, 0.0))[1]) / tokens
        parts[part] = parts.get(part, 0.0) + ms
        if part == "Ray (other)":
            name = process_name(cmd)
            other[name] = other.get(name, 0.0) + ms
    return parts, other


async def phases(server, args) -> dict:
    connector = aiohttp.TCPConnector(limit=200)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return await _phases(session, server, args)


async def _phases(http, server, args) -> dict:
    solo: list = []
    await ultrafast_requests(http, server, args, solo)
    per_stream: list[list[float]] = [[] for _ in range(args.streams)]
    stop = asyncio.Event()

    async def worker(stamps):
        while not stop.is_set():
            await lean_stream(http, server, "default", args.default_tokens, stamps)

    workers = [asyncio.create_task(worker(s)) for s in per_stream]
    await asyncio.sleep(args.warmup)
    cpu0, a0 = process_cpu_seconds(), time.perf_counter()
    await asyncio.sleep(args.window)
    cpu1, a1 = process_cpu_seconds(), time.perf_counter()
    tokens = sum(count_between(s, a0, a1) for s in per_stream)
    alone = tokens / (a1 - a0)
    cpu_ms, ray_other = cpu_ms_per_token(cpu0, cpu1, tokens)
    busy: list = []
    await ultrafast_requests(http, server, args, busy, args.window)
    b0, b1 = busy[0][1], busy[-1][2]
    during = sum(count_between(s, b0, b1) for s in per_stream) / (b1 - b0)
    stop.set()
    for w in workers:
        w.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    fast_solo = statistics.median(r[0] for r in solo)
    fast_busy = statistics.median(r[0] for r in busy)
    return {
        "ultrafast_tokens_per_s_alone": fast_solo,
        "ultrafast_tokens_per_s_with_default": fast_busy,
        "ultrafast_kept": fast_busy / fast_solo,
        "default_throughput_alone": alone,
        "default_throughput_with_ultrafast": during,
        "default_kept": during / alone,
        "cpu_ms_per_default_token": {k: v for k, v in cpu_ms.items() if v >= 0.005},
        "ray_other_ms_per_default_token": {k: v for k, v in ray_other.items() if v >= 0.001},
    }


SETTLE_PROBES = 5  # uncounted: the first probes after the phases wait on the cancelled streams


async def probe(http, servers: list, n: int) -> list[dict]:
    """e2e p50 and p99 of one-token completions, one at a time, once the system is idle (the
    phases' streams were just cancelled: the first probe after them waited 60 ms on their
    aborts in a fleet, against 6-12 ms for the others). With several servers the probes take
    turns, so a difference between them is not the machine changing between two runs."""
    times: list[list[float]] = [[] for _ in servers]
    for i in range(SETTLE_PROBES + n):
        for server, kept in zip(servers, times, strict=True):
            body = {"model": server.model, "prompt": "def f():", "max_tokens": 1, "temperature": 0}
            t0 = time.perf_counter()
            r = await http.post(server.url + "/v1/completions", json=body)
            r.raise_for_status()
            if i >= SETTLE_PROBES:
                kept.append(time.perf_counter() - t0)
    return [{"p50_ms": 1000 * percentile(t, 50), "p99_ms": 1000 * percentile(t, 99)} for t in times]


def report(name: str, r: dict) -> None:
    print(
        f"{name} ultrafast {r['ultrafast_tokens_per_s_alone']:.0f} tok/s alone, "
        f"{r['ultrafast_tokens_per_s_with_default']:.0f} with default traffic "
        f"({100 * r['ultrafast_kept']:.0f}%) | default {r['default_throughput_alone']:.0f} tok/s "
        f"alone, {r['default_throughput_with_ultrafast']:.0f} with ultrafast "
        f"({100 * r['default_kept']:.0f}%) | probe e2e p50 {r['probe']['p50_ms']:.1f} ms "
        f"p99 {r['probe']['p99_ms']:.1f} ms",
        flush=True,
    )
    if "lanes_probe" in r:
        lanes = r["lanes_probe"]
        print(f"       lanes in turn: p50 {lanes['p50_ms']:.1f} ms p99 {lanes['p99_ms']:.1f} ms")
    cpu = sorted(r["cpu_ms_per_default_token"].items(), key=lambda kv: -kv[1])
    print("       CPU ms per default token: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu))
    other = sorted(r.get("ray_other_ms_per_default_token", {}).items(), key=lambda kv: -kv[1])
    if other:
        print("       Ray (other): " + ", ".join(f"{k} {v:.3f}" for k, v in other))
    if "transport_ms_per_token" in r:
        print(f"       transport CPU ms per default token: {r['transport_ms_per_token']:.3f}")


async def lanes_run(args, lanes: Server) -> dict:
    """The lanes server's phases; it stays up for the fleets' probes to take turns with."""
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=200)) as http:
        await lanes.ready(http)
        r = await phases(lanes, args)
        [r["probe"]] = await probe(http, [lanes], args.probes)
    report("lanes", r)
    return r


async def fleet_run(args, intervals: tuple[int, int]) -> dict:
    """One fleet of the code this process imports (run as a child: `--fleet-only`)."""
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=200)) as http:
        fleet = Fleet(args.port + 1, intervals, args.http_mode)
        try:
            await stream(http, fleet, "default", 8, [])  # first request: handles, routers
            r = await phases(fleet, args)
            lanes = Lanes(args.lanes_url, fleet.model)
            r["probe"], r["lanes_probe"] = await probe(http, [fleet, lanes], args.probes)
        finally:
            fleet.stop()
    cpu = r["cpu_ms_per_default_token"]
    r["transport_ms_per_token"] = sum(cpu.get(part, 0.0) for part in TRANSPORT)
    return r


def fleet_in_child(
    args, src: Path, intervals: tuple[int, int], http: str | None, lanes_url: str
) -> dict:
    """`fleet_run` in a child process importing expresslane from `src` (so does its Ray)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fleet.json"
        cmd = [sys.executable, __file__, "--fleet-only", str(out), "--lanes-url", lanes_url]
        cmd += ["--intervals", f"{intervals[0]}:{intervals[1]}", *args.passed]
        cmd += ["--http-mode", http] if http else []
        env = {**os.environ, "PYTHONPATH": str(src)}
        subprocess.run(cmd, env=env, check=True)
        return json.loads(out.read_text())


def worktree(rev: str) -> Path:
    """The repository at `rev`, checked out (once) under the temporary directory."""
    repo = Path(__file__).resolve().parent.parent
    sha = subprocess.check_output(["git", "-C", str(repo), "rev-parse", rev], text=True).strip()
    path = Path(tempfile.gettempdir()) / f"expresslane-{sha[:12]}"
    if not path.exists():
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "add", "--detach", str(path), sha],
            check=True,
            capture_output=True,
        )
    return path / "src"


def fleet_runs(args, lanes_url: str) -> dict:
    """Each fleet of the run (`--before`, then today's per `--http` mode and `--intervals`)."""
    here = Path(__file__).resolve().parent.parent / "src"
    fleets = [(f"before ({args.before})", worktree(args.before), None)] if args.before else []
    for mode in args.http:
        fleets.append(("fleet" if mode == "direct" else f"fleet, {mode}", here, mode))
    results = {}
    for label, src, mode in fleets:
        for fast, std in args.intervals:
            name = label if (fast, std) == (1, 1) else f"{label}, stream_interval {fast}/{std}"
            results[name] = fleet_in_child(args, src, (fast, std), mode, lanes_url)
            report(name, results[name])
    return results


def one_run(args) -> dict:
    args.model = None
    lanes = Server(args, args.port, [])
    try:
        results = {"lanes": asyncio.run(lanes_run(args, lanes))}
        results.update(fleet_runs(args, lanes.url))
    finally:
        lanes.stop()
    for name, r in results.items():
        if name != "lanes":
            p_lanes = r["lanes_probe"]  # taken in turns with this fleet's probes
            r["added_ms"] = {q: r["probe"][f"{q}_ms"] - p_lanes[f"{q}_ms"] for q in ("p50", "p99")}
            print(
                f"{name}: added latency p50 {r['added_ms']['p50']:.1f} ms, "
                f"p99 {r['added_ms']['p99']:.1f} ms"
            )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--default-tokens", type=int, default=256)
    ap.add_argument("--ultrafast", type=int, default=8)
    ap.add_argument("--ultrafast-tokens", type=int, default=128)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--probes", type=int, default=50)
    ap.add_argument("--port", type=int, default=8751)
    ap.add_argument(
        "--intervals",
        type=lambda text: [tuple(int(n) for n in pair.split(":")) for pair in text.split(",")],
        default=[(1, 1)],
        help="fleet runs, one per FAST:STD pair of the pools' stream_interval (e.g. 1:1,8:4)",
    )
    ap.add_argument("--before", help="also run the fleet of this git revision, first")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument(
        "--http",
        type=lambda text: text.split(","),
        default=["direct"],
        help="today's fleet once per [ingress] http mode (direct, serve-proxy)",
    )
    ap.add_argument("--http-mode", help=argparse.SUPPRESS)  # a child's
    ap.add_argument("--fleet-only", help=argparse.SUPPRESS)  # a child's output file
    ap.add_argument("--lanes-url", help=argparse.SUPPRESS)  # a child's: the lanes server
    args = ap.parse_args()
    # what a child fleet gets: every option but those that choose the runs
    args.passed = _without(
        sys.argv[1:], ("--intervals", "--before", "--runs", "--fleet-only", "--http", "--http-mode")
    )
    if args.fleet_only:
        (fast, std), *_ = args.intervals
        result = asyncio.run(fleet_run(args, (fast, std)))
        Path(args.fleet_only).write_text(json.dumps(result))
        return
    results = {"machine": machine(), "settings": vars(args), "runs": []}
    for _ in range(args.runs):
        results["runs"].append(one_run(args))
    print(f"results: {Path(save_results('fleet', results))}")


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """`argv` less `options` and their values."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a.split("=")[0] in options:
            skip = "=" not in a
        else:
            out.append(a)
    return out


if __name__ == "__main__":
    main()
