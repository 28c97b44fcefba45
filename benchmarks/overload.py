"""Overload: ten times the load a real `expresslane serve` can hold, and what it does with it.

First the server's capacity is measured: `--clients` closed-loop clients send short requests
for `--calibrate-seconds` and the completed requests per second are its throughput. Then
requests arrive open-loop at `--factor` (10) times that rate for `--seconds`, spread over
the tiers, each with a client-side limit of `--timeout` seconds, while /health is polled every
quarter second. The acceptance (issue 25): every request is served or refused with 429 and
`Retry-After` (no 5xx, no transport error, none hits the client limit), and /health answers
within 1 s throughout. JSON goes to benchmarks/results/overload-TIME.json.

    python benchmarks/overload.py [--factor 10] [--seconds 60] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, save_results  # noqa: E402
from soak import TIERS, ServerProcess, percentile  # noqa: E402


def body(model: str, tier: str, tokens: int) -> dict:
    return {
        "model": model,
        "input": "def add(a, b):",
        "max_output_tokens": tokens,
        "service_tier": tier,
        "store": False,
    }


async def calibrate(url: str, model: str, clients: int, seconds: float, tokens: int) -> float:
    """Completed requests per second with `clients` closed-loop clients (default tier)."""
    done = 0
    stop = time.monotonic() + seconds

    async def loop(c: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < stop:
            r = await c.post("/v1/responses", json=body(model, "default", tokens))
            done += r.status_code == 200

    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        start = time.monotonic()
        await asyncio.gather(*(loop(c) for _ in range(clients)))
        return done / (time.monotonic() - start)


async def one(c: httpx.AsyncClient, payload: dict, timeout: float, out: list[dict]) -> None:
    start = time.monotonic()
    try:
        r = await c.post("/v1/responses", json=payload, timeout=timeout)
        status, retry = r.status_code, r.headers.get("retry-after")
        limits = any(h.startswith("x-ratelimit-") for h in r.headers)
    except httpx.TimeoutException:
        status, retry, limits = "timeout", None, False
    except httpx.TransportError as e:
        status, retry, limits = f"transport:{type(e).__name__}", None, False
    out.append(
        {
            "tier": payload["service_tier"],
            "status": status,
            "seconds": time.monotonic() - start,
            "retry_after": retry,
            "ratelimit_headers": limits,
        }
    )


async def poll_health(url: str, stop: asyncio.Event, out: list[float]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        while not stop.is_set():
            start = time.monotonic()
            try:
                await c.get("/health")
                out.append(time.monotonic() - start)
            except httpx.TransportError:
                out.append(float("inf"))
            await asyncio.sleep(0.25)


async def flood(url: str, model: str, rate: float, args) -> tuple[list[dict], list[float]]:
    rng = random.Random(args.seed)
    results: list[dict] = []
    health: list[float] = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, limits=limits) as c:
        poller = asyncio.create_task(poll_health(url, stop, health))
        tasks = []
        start = time.monotonic()
        next_at = start
        while next_at < start + args.seconds:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            payload = body(model, rng.choice(TIERS), args.tokens)
            tasks.append(asyncio.create_task(one(c, payload, args.timeout, results)))
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        stop.set()
        await poller
    return results, health


def summarize(results: list[dict], health: list[float], capacity: float, args) -> dict:
    statuses = Counter(str(r["status"]) for r in results)
    per_tier = {
        tier: dict(Counter(str(r["status"]) for r in results if r["tier"] == tier))
        for tier in TIERS
    }
    served = [r["seconds"] for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 429]
    bad = [r for r in results if r["status"] not in (200, 429)]
    return {
        "capacity_requests_per_s": capacity,
        "offered_requests_per_s": capacity * args.factor,
        "requests": len(results),
        "statuses": dict(statuses),
        "statuses_per_tier": per_tier,
        "served_p50_s": percentile(served, 50),
        "served_p99_s": percentile(served, 99),
        "served_max_s": max(served, default=None),
        "refused_max_s": max((r["seconds"] for r in refused), default=None),
        "refused_without_retry_after": sum(r["retry_after"] is None for r in refused),
        "refused_without_ratelimit_headers": sum(not r["ratelimit_headers"] for r in refused),
        "not_served_nor_429": len(bad),
        "health_samples": len(health),
        "health_max_s": max(health, default=None),
        "health_p50_s": statistics.median(health) if health else None,
        "pass": not bad
        and all(r["retry_after"] and r["ratelimit_headers"] for r in refused)
        and bool(health)
        and max(health) < 1.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--factor", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--calibrate-seconds", type=float, default=20.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    server = ServerProcess(args.model).start()
    try:
        capacity = asyncio.run(
            calibrate(server.url, server.model, args.clients, args.calibrate_seconds, args.tokens)
        )
        rate = capacity * args.factor
        print(f"capacity {capacity:.1f} requests/s; offering {rate:.1f}/s for {args.seconds:g} s")
        results, health = asyncio.run(flood(server.url, server.model, rate, args))
        summary = summarize(results, health, capacity, args)
        summary["server_errors_logged"] = len(server.log_errors())
        summary["server_alive"] = server.alive()
    finally:
        server.stop()
    path = save_results("overload", {"machine": machine(), "args": vars(args), **summary})
    for key, value in summary.items():
        print(f"{key:36s} {value}")
    print(f"wrote {path}")
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
