"""Anthropic's fast mode on the Messages API, served by the ultrafast lane (issue 69).

One `expresslane serve` (the demo model unless --model) with a fresh accounts file and keys:
"load" (default tier), "fast" and "fast2" (ultrafast allowed, `queue` policy), "reject" and
"down" (ultrafast with `reject` and `downgrade` policies). Then:

  1. `--streams` default-tier streams of 512 tokens run for the whole test (chat, since the
     Messages API has no `ignore_eos`; the lanes are shared);
  2. `--requests` `speed: "fast"` streamed requests one after another: each must say
     `usage.speed: "fast"` and carry the `anthropic-fast-*` headers, and its decode speed
     (client-side, from `content_block_delta` events, the first excluded) is compared with
     the lane's published promise (`/v1/tiers`): the floor per request, the median over all;
  3. the fast lane filled by "fast" and "fast2" streams, then one more from "reject" (a 429 with
     `retry-after`, and how long it took) and one from "down" (`usage.speed: "standard"`).

    python benchmarks/messages_fast.py [--model FILE] [--streams 16] [--requests 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import machine, save_results

PROMPT = [{"role": "user", "content": "def parse_config(path):"}]


def make_keys(db: str) -> dict[str, str]:
    plans = {
        "load": ["--tiers", "default"],
        "fast": ["--tiers", "ultrafast,default", "--tpm", "100000000"],
        "fast2": ["--tiers", "ultrafast,default"],
        "reject": ["--tiers", "ultrafast,default", "--when-unavailable", "reject"],
        "down": ["--tiers", "ultrafast,default", "--when-unavailable", "downgrade"],
    }
    keys = {}
    for name, flags in plans.items():
        cmd = [sys.executable, "-m", "expresslane.cli", "keys", "create", name, *flags]
        out = subprocess.run([*cmd, "--json", "--db", db], capture_output=True, check=True)
        keys[name] = json.loads(out.stdout)["key"]
    return keys


def body(model: str, max_tokens: int, fast: bool) -> dict:
    extra = {"speed": "fast"} if fast else {}
    return {
        "model": model,
        "max_tokens": max_tokens,
        "messages": PROMPT,
        "stream": True,
        **extra,
    }


async def message(http, url: str, key: str, payload: dict) -> dict:
    """One streamed message: status, headers, usage and its token times."""
    stamps, usage, status = [], {}, None
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    async with http.stream("POST", url + "/v1/messages", json=payload, headers=headers) as r:
        status, got = r.status_code, dict(r.headers)
        if status != 200:
            return {
                "status": status,
                "headers": got,
                "usage": {},
                "stamps": [],
                "error": (await r.aread()).decode()[:300],
            }
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "content_block_delta":
                stamps.append(time.perf_counter())
            elif event["type"] == "message_delta":
                usage = event.get("usage", {})
    return {"status": status, "headers": got, "usage": usage, "stamps": stamps}


def decode_speed(stamps: list[float], tokens: int) -> float | None:
    if tokens < 2 or len(stamps) < 2 or stamps[-1] <= stamps[0]:
        return None
    return (tokens - 1) / (stamps[-1] - stamps[0])


async def hold(http, url, key, model, tier: str, tokens: int) -> None:
    """A long chat stream on `tier` that runs to `tokens` (the Messages API has no ignore_eos;
    the lanes are the same whatever the API)."""
    payload = {
        "model": model,
        "messages": PROMPT,
        "max_tokens": tokens,
        "stream": True,
        "ignore_eos": True,
        "service_tier": tier,
    }
    headers = {"authorization": f"Bearer {key}"}
    async with http.stream(
        "POST", url + "/v1/chat/completions", json=payload, headers=headers
    ) as r:
        async for _ in r.aiter_lines():
            pass


async def load(http, url, key, model, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await hold(http, url, key, model, "default", 512)


async def run(args, url: str, keys: dict[str, str]) -> dict:
    auth = {"authorization": f"Bearer {keys['fast']}"}
    async with httpx.AsyncClient(timeout=600) as http:
        model = (await http.get(url + "/v1/models", headers=auth)).json()["data"][0]["id"]
        promise = await wait_promise(http, url, auth)
        stop = asyncio.Event()
        loaders = [
            asyncio.create_task(load(http, url, keys["load"], model, stop))
            for _ in range(args.streams)
        ]
        await asyncio.sleep(args.warmup)
        fast = []
        for _ in range(args.requests):
            got = await message(http, url, keys["fast"], body(model, args.tokens, fast=True))
            tokens = got["usage"].get("output_tokens", 0)
            fast.append(
                {
                    "status": got["status"],
                    "error": got.get("error"),
                    "speed": got["usage"].get("speed"),
                    "tokens_per_s": decode_speed(got["stamps"], tokens),
                    "fast_headers": sorted(h for h in got["headers"] if "anthropic-fast" in h),
                    "served_tier": got["headers"].get("x-expresslane-served-tier"),
                }
            )
        full = await past_capacity(http, url, keys, model)
        stop.set()
        await asyncio.gather(*loaders, return_exceptions=True)
    return {"promise": promise, "fast": fast, "past_capacity": full}


async def wait_promise(http, url: str, auth: dict) -> dict:
    for _ in range(1200):
        tiers = (await http.get(url + "/v1/tiers", headers=auth)).json()["data"]
        promise = next(t for t in tiers if t["id"] == "ultrafast").get("promise")
        if isinstance(promise, dict) and "tokens_per_s" in promise:
            return promise
        await asyncio.sleep(0.5)
    raise RuntimeError("the ultrafast promise was never stated")


async def past_capacity(http, url, keys, model) -> dict:
    """Fill the fast lane with long fast requests of two keys (one key runs at most half of
    its slots), then ask once more per policy."""
    holders = [
        asyncio.create_task(hold(http, url, keys[name], model, "ultrafast", 1500))
        for name in ("fast", "fast2")
        for _ in range(2)
    ]
    await asyncio.sleep(3)
    start = time.perf_counter()
    refused = await message(http, url, keys["reject"], body(model, 4, fast=True))
    refused_s = time.perf_counter() - start
    down = await message(http, url, keys["down"], body(model, 4, fast=True))
    for task in holders:
        task.cancel()
    await asyncio.gather(*holders, return_exceptions=True)
    return {
        "reject_status": refused["status"],
        "reject_retry_after": refused["headers"].get("retry-after"),
        "reject_seconds": round(refused_s, 3),
        "down_speed": down["usage"].get("speed"),
        "down_served_tier": down["headers"].get("x-expresslane-served-tier"),
    }


def report(result: dict) -> None:
    promise, fast = result["promise"], result["fast"]
    speeds = [f["tokens_per_s"] for f in fast if f["tokens_per_s"]]
    floor = promise["floor_tokens_per_s"]
    print(f"promise: {promise['tokens_per_s']} tok/s at p{promise['percentile']}, floor {floor}")
    print(f"fast requests: {len(fast)}; usage.speed {sorted({str(f['speed']) for f in fast})}")
    if not speeds:
        print("no fast request decoded:", fast[0])
        return
    print(f"  tokens/s: median {statistics.median(speeds):.1f}, min {min(speeds):.1f}")
    print(f"  at or above the floor: {sum(s >= floor for s in speeds)}/{len(speeds)}")
    print(f"  headers: {fast[0]['fast_headers']}")
    print(f"past capacity: {result['past_capacity']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128, help="output tokens per fast request")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of load before measuring")
    p.add_argument("--port", type=int, default=8931)
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="messages-fast-"))
    db = str(folder / "accounts.sqlite")
    keys = make_keys(db)
    cmd = [sys.executable, "-m", "expresslane.cli", "serve", "--port", str(args.port)]
    cmd += ["--model", args.model] if args.model else []
    env = {**os.environ, "EXPRESSLANE_ACCOUNTS": db, "EXPRESSLANE_STORE": ":memory:"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_up(url)
        result = asyncio.run(run(args, url, keys))
    finally:
        proc.terminate()
        proc.wait(30)
    result |= {"machine": machine(), "args": vars(args)}
    report(result)
    print("results:", save_results("messages_fast", result))


def wait_up(url: str) -> None:
    for _ in range(1200):
        try:
            if httpx.get(url + "/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not start")


if __name__ == "__main__":
    main()
