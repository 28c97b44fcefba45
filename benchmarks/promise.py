"""The ultrafast promise under load: admission, downgrade, refusal and billing, measured.

One `expresslane serve` (the demo model unless --model) with real API keys, one client
process. `--streams` default streams of long outputs run throughout (each restarts when it
ends). First `--window` seconds without ultrafast traffic (the default lane's throughput
alone), then ultrafast concurrency ramped through `--levels` (1, 2, 4, ... past the lane's
capacity), `--window` seconds each: at every level half the ultrafast clients hold a key that
downgrades when the lane is full and half one that is refused (429); each client sends its
next request as soon as the last ends (after a 429, after its Retry-After, as the openai SDK
waits, or `--backoff`).

Reported per level: ultrafast requests served, downgraded and refused; the time from sending
a request to its answer's first byte for those downgraded or refused (the decision, target
≤ 50 ms); client-side decode speed of the served ones against the published promise; the
default lane's throughput against its throughput alone. Over the run, from the server's own
ledger: the share of ultrafast-served requests that kept the promise (target ≥ 99%), that
downgraded rows are priced at the default tier, missed ones at the default price with their
refund, and that billed + refunded = list price for every row.

    python benchmarks/promise.py [--streams 32] [--levels 1,2,4,8,16] [--window 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import event_tokens, machine, save_results, stream_body

from expresslane.cli import main as cli

PRICES = {"input": 0.10, "cached": 0.025, "output": 0.40}  # the defaults, per 1M tokens
MULTIPLIER = {"ultrafast": 6.0, "default": 1.0, "flex": 0.5}


def make_key(db: str, name: str, *flags: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli(["keys", "create", name, *flags, "--json", "--db", db]) == 0
    return json.loads(out.getvalue())["key"]


class Server:
    def __init__(self, args, accounts: str):
        cmd = [sys.executable, "-m", "expresslane.cli", "serve", "--port", str(args.port)]
        cmd += ["--log-format", "json"]
        if args.model:
            cmd += ["--model", args.model]
        env = {**os.environ, "EXPRESSLANE_ACCOUNTS": accounts, "EXPRESSLANE_STORE": ":memory:"}
        self.log = Path(accounts).with_name("server.log")
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{args.port}"

    async def ready(self, http: httpx.AsyncClient, key: str) -> dict:
        """The published tiers, once the server has measured its promise."""
        for _ in range(1200):
            with contextlib.suppress(httpx.TransportError):
                r = await http.get(self.url + "/v1/tiers", headers=auth(key))
                if r.status_code == 200:
                    tiers = {t["id"]: t for t in r.json()["data"]}
                    if "tokens_per_s" in (tiers["ultrafast"]["promise"] or {}):
                        models = await http.get(self.url + "/v1/models", headers=auth(key))
                        self.model = models.json()["data"][0]["id"]
                        return tiers
            await asyncio.sleep(0.5)
        raise RuntimeError("the server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def auth(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


async def request(http, server, key: str, tier: str, max_tokens: int, stamps=None) -> dict:
    """One streamed completion: when its answer began, its status and served tier, and a
    timestamp per received token (appended to `stamps` as they come, if given)."""
    body = stream_body(server.model, tier, max_tokens)
    sent = time.perf_counter()
    out = {"sent": sent, "stamps": [] if stamps is None else stamps}
    async with http.stream(
        "POST", server.url + "/v1/completions", json=body, headers=auth(key)
    ) as r:
        out["answered"] = time.perf_counter()
        out["status"] = r.status_code
        out["served"] = r.headers.get("x-expresslane-served-tier")
        out["retry_after"] = float(r.headers.get("retry-after", 0))
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                out["stamps"] += [time.perf_counter()] * event_tokens(line[6:])
    return out


async def default_worker(http, server, key, args, stamps: list[float], stop: asyncio.Event):
    while not stop.is_set():
        await request(http, server, key, "default", args.default_tokens, stamps)


async def ultrafast_worker(http, server, key, args, results: list[dict], until: float):
    while time.perf_counter() < until:
        got = await request(http, server, key, "ultrafast", args.ultrafast_tokens)
        got["key"] = key
        results.append(got)
        if got["status"] == 429:  # as the openai SDK does: wait what Retry-After says
            await asyncio.sleep(got["retry_after"] if args.backoff is None else args.backoff)


def speed(stamps: list[float]) -> float | None:
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        return None
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def level_summary(level: int, got: list[dict], keys: dict, default_tps: float, promise: dict):
    served = [g for g in got if g["status"] == 200 and g["served"] == "ultrafast"]
    down = [g for g in got if g["status"] == 200 and g["served"] == "default"]
    refused = [g for g in got if g["status"] == 429]
    decided = [1000 * (g["answered"] - g["sent"]) for g in down + refused]
    speeds = [s for s in (speed(g["stamps"]) for g in served) if s is not None]
    floor = promise["floor_tokens_per_s"]
    return {
        "level": level,
        "ultrafast_served": len(served),
        "downgraded": len(down),
        "refused": len(refused),
        "other": len(got) - len(served) - len(down) - len(refused),
        "downgraded_by_key": sum(g["key"] == keys["down"] for g in down),
        "decision_ms_p50": pct(decided, 50),
        "decision_ms_p99": pct(decided, 99),
        "decision_ms_max": max(decided, default=None),
        "served_tokens_per_s_p50": pct(speeds, 50),
        "served_below_floor_client": sum(s < floor for s in speeds),
        "default_throughput": default_tps,
    }


async def run(args, server: Server, keys: dict, tiers: dict) -> dict:
    promise = tiers["ultrafast"]["promise"]
    per_stream: list[list[float]] = [[] for _ in range(args.streams)]
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=400)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        workers = [
            asyncio.create_task(default_worker(http, server, keys["default"], args, s, stop))
            for s in per_stream
        ]
        await asyncio.sleep(args.warmup)
        t0 = time.perf_counter()
        await asyncio.sleep(args.window)
        t1 = time.perf_counter()
        alone = sum(sum(t0 <= t <= t1 for t in s) for s in per_stream) / (t1 - t0)
        print(f"default lane alone: {alone:.0f} tokens/s over {args.streams} streams")
        levels = []
        for level in [int(x) for x in args.levels.split(",")]:
            got: list[dict] = []
            start = time.perf_counter()
            until = start + args.window
            clients = [
                ultrafast_worker(
                    http, server, keys["down" if i % 2 == 0 else "reject"], args, got, until
                )
                for i in range(level)
            ]
            await asyncio.gather(*clients)
            end = time.perf_counter()
            default_tps = sum(sum(start <= t <= end for t in s) for s in per_stream) / (end - start)
            summary = level_summary(level, got, keys, default_tps, promise)
            levels.append(summary)
            report_level(summary, alone, promise)
        stop.set()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return {"default_alone_throughput": alone, "levels": levels}


def report_level(s: dict, alone: float, promise: dict) -> None:
    fmt = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"
    print(
        f"ultrafast x{s['level']:>2}: served {s['ultrafast_served']:>4}, downgraded "
        f"{s['downgraded']:>4}, refused {s['refused']:>4}; decision p50/p99/max "
        f"{fmt(s['decision_ms_p50'])}/{fmt(s['decision_ms_p99'])}/{fmt(s['decision_ms_max'])} "
        f"ms; served tok/s p50 {fmt(s['served_tokens_per_s_p50'])} (promise "
        f"{promise['tokens_per_s']}, floor {promise['floor_tokens_per_s']}); default "
        f"{s['default_throughput']:.0f} tok/s ({s['default_throughput'] / alone:.0%} of alone)"
    )


def server_decisions(log: Path) -> dict:
    """The server's own time for each 429 it answered (its request log): the decision alone,
    without the client's or the network's share."""
    ms = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if entry.get("status") == 429 and entry.get("path") == "/v1/completions":
                ms.append(1000 * entry["duration_s"])
    return {
        "refusals": len(ms),
        "p50_ms": pct(ms, 50),
        "p99_ms": pct(ms, 99),
        "max_ms": max(ms, default=None),
    }


def ledger_check(db: str) -> dict:
    """The ledger's ultrafast-requested rows: promise kept, prices as served, totals."""
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    rows = [dict(r) for r in conn.execute("SELECT * FROM ledger")]
    conn.close()
    served = [
        r for r in rows if r["tier_served"] == "ultrafast" and r["status"] in ("stop", "length")
    ]
    judged = [r for r in served if r["promise_kept"] is not None]
    down = [r for r in rows if r["tier_requested"] == "ultrafast" and r["tier_served"] == "default"]
    mismatched = 0
    for r in rows:
        if r["status"] == "error":
            continue
        listed = (
            (r["input_tokens"] - r["cached_tokens"]) * PRICES["input"]
            + r["cached_tokens"] * PRICES["cached"]
            + r["output_tokens"] * PRICES["output"]
        ) / 1e6
        m = MULTIPLIER[r["tier_served"]]
        expect = listed * (MULTIPLIER["default"] if r["promise_kept"] == 0 else m)
        ok = abs(r["cost"] - expect) < 1e-12 and abs(r["cost"] + r["refund"] - listed * m) < 1e-12
        mismatched += not ok
    kept = sum(r["promise_kept"] for r in judged)
    return {
        "rows": len(rows),
        "ultrafast_served": len(served),
        "judged": len(judged),
        "kept": kept,
        "attainment": kept / len(judged) if judged else None,
        "missed_by": {
            "ttft": sum(
                r["promise_kept"] == 0 and r["ttft_s"] > r["promised_ttft_s"] for r in judged
            ),
            "speed": sum(
                r["promise_kept"] == 0 and r["ttft_s"] <= r["promised_ttft_s"] for r in judged
            ),
        },
        "all_carry_promise": all(
            r["promised_tokens_per_s"] is not None and r["delivered_tokens_per_s"] is not None
            for r in judged
        ),
        "downgraded_rows": len(down),
        "downgraded_at_default_price": all(r["refund"] == 0 for r in down),
        "rows_priced_wrong": mismatched,
        "billed": sum(r["cost"] for r in rows),
        "refunded": sum(r["refund"] for r in rows),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="default: the bundled demo model")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--levels", default="1,2,4,8,16")
    p.add_argument("--window", type=float, default=20.0, help="seconds per phase")
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--default-tokens", type=int, default=256)
    p.add_argument("--ultrafast-tokens", type=int, default=64)
    p.add_argument(
        "--backoff", type=float, default=None, help="seconds after a 429 (default: Retry-After)"
    )
    p.add_argument("--port", type=int, default=8790)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="promise-")
    db = str(Path(tmp) / "accounts.sqlite")
    both = ["--tiers", "ultrafast,default"]
    keys = {
        "default": make_key(db, "load", "--tiers", "default"),
        "down": make_key(db, "fast-down", *both, "--when-unavailable", "downgrade"),
        "reject": make_key(db, "fast-reject", *both, "--when-unavailable", "reject"),
    }
    server = Server(args, db)
    try:
        tiers = asyncio.run(_ready(server, keys))
        print(f"published promise: {json.dumps(tiers['ultrafast']['promise'])}")
        result = asyncio.run(run(args, server, keys, tiers))
    finally:
        server.stop()
    result["promise"] = tiers["ultrafast"]["promise"]
    result["server_decisions"] = decided = server_decisions(server.log)
    print(
        f"server-side 429 decisions: {decided['refusals']}, p50/p99/max "
        f"{decided['p50_ms']:.1f}/{decided['p99_ms']:.1f}/{decided['max_ms']:.1f} ms"
        if decided["refusals"]
        else "no 429 answered"
    )
    result["ledger"] = ledger_check(db)
    led = result["ledger"]
    print(
        f"ledger: {led['judged']} ultrafast requests judged, {led['kept']} kept "
        f"({100 * (led['attainment'] or 0):.2f}%, missed by TTFT {led['missed_by']['ttft']}, "
        f"by speed {led['missed_by']['speed']}); {led['downgraded_rows']} downgraded rows; "
        f"{led['rows_priced_wrong']} of {led['rows']} rows priced wrong; billed "
        f"{led['billed']:.6f}, refunded {led['refunded']:.6f}"
    )
    out = save_results("promise", {"machine": machine(), "settings": vars(args), **result})
    print(f"wrote {out}")


async def _ready(server: Server, keys: dict) -> dict:
    async with httpx.AsyncClient(timeout=30) as http:
        return await server.ready(http, keys["down"])


if __name__ == "__main__":
    main()
