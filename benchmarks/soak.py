"""Soak: a real `expresslane serve` under a bounded mixed workload; memory, latency and errors
over time.

One server process (the demo model unless --model) on 127.0.0.1 and a free port, its response
store and accounts database in a temporary folder. `--clients` clients loop until `--minutes`
have passed, each time picking (seeded) one action of every kind the server offers, in every
tier (ultrafast, default, flex): Responses plain, SSE streams (some left mid-stream), background
jobs polled to the end (some cancelled), stored chains through `previous_response_id` with
retrieve, input items and delete, chat completion streams (some left mid-stream), completions,
and WebSocket-mode turns (some closed mid-stream). Every few seconds the server's RSS
(/proc/PID/status VmRSS) and the latency of /health are sampled.

Reported: RSS at the end of warm-up (`--warmup-minutes`, default 2) and at the end, the RSS
slope after warm-up (MB/min, least squares) and the largest deviation from the post-warm-up
mean (%), p50/p99 latency and errors per minute, the last minute's p99 against the second
minute's, totals. The acceptance lines (issue 25): RSS within ±5% after warm-up, 0 errors, last
p99 within 20% of the second minute's. JSON goes to benchmarks/results/soak-TIME.json.

    python benchmarks/soak.py [--minutes 30] [--clients 6] [--model DIR] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import websockets

TIERS = ("ultrafast", "default", "flex")
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
DONE_STATUSES = {"completed", "incomplete", "failed", "cancelled"}
PROMPTS = [
    "def add(a, b):",
    'def parse_config(path):\n    """Read the config file at *path*."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):",
    "import json\n\n\ndef load(path):\n    with open(path) as f:",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


class ServerProcess:
    """`expresslane serve` in a subprocess on 127.0.0.1 and a free port; store, accounts and
    log in a temporary folder (removed by `stop`)."""

    def __init__(self, model: str | None = None, extra_args: tuple[str, ...] = ()):
        self.dir = Path(tempfile.mkdtemp(prefix="expresslane-bench-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/responses"
        self.cmd = [sys.executable, "-m", "expresslane.cli", "serve", "--port", str(self.port)]
        self.cmd += ["--accounts", str(self.dir / "accounts.sqlite")]
        self.cmd += (["--model", model] if model else []) + list(extra_args)
        self.model = ""
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 900) -> ServerProcess:
        env = {**os.environ, "EXPRESSLANE_STORE": str(self.dir / "responses.sqlite")}
        self.log_file = open(self.dir / "server.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            self.cmd, env=env, stdout=self.log_file, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("the server exited while starting:\n" + self.log_tail())
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    models = httpx.get(self.url + "/v1/models", timeout=5).json()
                    self.model = models["data"][0]["id"]
                    return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("the server did not start in time")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_mb(self) -> float | None:
        """Resident memory of the server process (VmRSS), in MB."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except (OSError, AttributeError):
            return None
        return None

    def log_tail(self, lines: int = 40) -> str:
        path = self.dir / "server.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def log_errors(self) -> list[str]:
        """Lines of the server log that report an error (first line of each)."""
        path = self.dir / "server.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return [ln for ln in text.splitlines() if " ERROR " in ln or ln.startswith("ERROR")]

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 60 s; returns the exit code and removes the folder."""
        code = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait(10)
        elif self.proc is not None:
            code = self.proc.returncode
        with contextlib.suppress(AttributeError):
            self.log_file.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return code


# -- the workload -----------------------------------------------------------------------------


@dataclass
class Outcome:
    ok: bool
    status: int | None = None
    error: str | None = None


@dataclass
class Ctx:
    server: ServerProcess
    http: httpx.AsyncClient
    rng: random.Random
    max_tokens: int
    records: list[dict] = field(default_factory=list)

    def body(self, tier: str, **kw) -> dict:
        prompt = self.rng.choice(PROMPTS) + f"\n# {self.rng.randrange(10**6)}\n"
        return {
            "model": self.server.model,
            "input": prompt,
            "max_output_tokens": self.max_tokens,
            "ignore_eos": True,
            "temperature": self.rng.choice([0, 0.7]),
            "service_tier": tier,
            **kw,
        }


def _fail(r: httpx.Response) -> Outcome:
    return Outcome(False, r.status_code, r.text[:300])


async def responses_plain(ctx: Ctx, tier: str) -> Outcome:
    r = await ctx.http.post("/v1/responses", json=ctx.body(tier, store=ctx.rng.random() < 0.5))
    if r.status_code != 200 or r.json().get("status") not in ("completed", "incomplete"):
        return _fail(r)
    return Outcome(True, 200)


async def _sse(ctx: Ctx, path: str, body: dict, leave_after: int | None) -> Outcome:
    """A streamed request read to its end (Chat: `[DONE]`; Responses: its terminal event), or
    left after `leave_after` data lines."""
    seen, finished = 0, False
    async with ctx.http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return _fail(r)
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                finished = True
                break
            data = json.loads(line[6:])
            if data.get("type") in ("response.failed", "error") or "error" in data:
                return Outcome(False, 200, line[:300])
            if data.get("type") in ("response.completed", "response.incomplete"):
                finished = True
                break
            seen += 1
            if leave_after is not None and seen >= leave_after:
                return Outcome(True, 200)  # the client leaves mid-stream
    return Outcome(finished, 200, None if finished else "the stream ended before its end")


async def responses_stream(ctx: Ctx, tier: str, leave: bool = False) -> Outcome:
    leave_after = ctx.rng.randint(2, ctx.max_tokens) if leave else None
    return await _sse(ctx, "/v1/responses", ctx.body(tier, stream=True), leave_after)


async def chat_stream(ctx: Ctx, tier: str, leave: bool = False) -> Outcome:
    body = ctx.body(tier)
    body = {
        "model": body["model"],
        "messages": [{"role": "user", "content": body.pop("input")}],
        "max_tokens": ctx.max_tokens,
        "ignore_eos": True,
        "service_tier": tier,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    leave_after = ctx.rng.randint(1, ctx.max_tokens) if leave else None
    return await _sse(ctx, "/v1/chat/completions", body, leave_after)


async def completions(ctx: Ctx, tier: str) -> Outcome:
    b = ctx.body(tier)
    body = {
        "model": b["model"],
        "prompt": b["input"],
        "max_tokens": ctx.max_tokens,
        "ignore_eos": True,
        "service_tier": tier,
    }
    r = await ctx.http.post("/v1/completions", json=body)
    return Outcome(True, 200) if r.status_code == 200 else _fail(r)


async def background(ctx: Ctx, tier: str, cancel: bool = False) -> Outcome:
    r = await ctx.http.post("/v1/responses", json=ctx.body(tier, background=True))
    if r.status_code != 200:
        return _fail(r)
    rid = r.json()["id"]
    for polls in range(600):  # bounded: 600 polls of 0.2 s at most
        await asyncio.sleep(0.2)
        if cancel and polls == 0:
            c = await ctx.http.post(f"/v1/responses/{rid}/cancel")
            if c.status_code != 200:
                return _fail(c)
        g = await ctx.http.get(f"/v1/responses/{rid}")
        if g.status_code != 200:
            return _fail(g)
        status = g.json()["status"]
        if status in DONE_STATUSES:
            ok = status in (
                ("cancelled", "completed", "incomplete") if cancel else ("completed", "incomplete")
            )
            return Outcome(ok, 200, None if ok else f"background job ended {status}")
    return Outcome(False, None, "background job never finished")


async def stored_chain(ctx: Ctx, tier: str) -> Outcome:
    first = await ctx.http.post("/v1/responses", json=ctx.body(tier, store=True))
    if first.status_code != 200:
        return _fail(first)
    a = first.json()["id"]
    second = await ctx.http.post(
        "/v1/responses", json=ctx.body(tier, store=True, previous_response_id=a)
    )
    if second.status_code != 200:
        return _fail(second)
    b = second.json()["id"]
    for url in (f"/v1/responses/{b}", f"/v1/responses/{b}/input_items"):
        got = await ctx.http.get(url)
        if got.status_code != 200:
            return _fail(got)
    for rid in (b, a):
        gone = await ctx.http.delete(f"/v1/responses/{rid}")
        if gone.status_code != 200:
            return _fail(gone)
    return Outcome(True, 200)


async def _ws_turn(ws, leave: bool) -> tuple[str | None, str | None]:
    """Events of one turn up to its end: (response id, error text)."""
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), 120))
        if event["type"] == "error":
            return None, json.dumps(event)[:300]
        if leave and event["type"] == "response.output_text.delta":
            return None, None
        if event["type"] in TERMINAL:
            if event["type"] == "response.failed":
                return None, json.dumps(event["response"].get("error"))[:300]
            return event["response"]["id"], None


async def websocket_turns(ctx: Ctx, tier: str, leave: bool = False) -> Outcome:
    async with websockets.connect(ctx.server.ws_url, open_timeout=30) as ws:
        body = ctx.body(tier, store=False)
        await ws.send(json.dumps({"type": "response.create", **body}))
        rid, err = await _ws_turn(ws, leave)
        if err or leave:
            return Outcome(err is None, 101, err)
        body = ctx.body(tier, store=False, previous_response_id=rid)
        await ws.send(json.dumps({"type": "response.create", **body}))
        _, err = await _ws_turn(ws, False)
    return Outcome(err is None, 101, err)


Action = Callable[[Ctx, str], Awaitable[Outcome]]
ACTIONS: list[tuple[str, float, Action]] = [
    ("responses", 2, responses_plain),
    ("responses_stream", 3, responses_stream),
    ("responses_stream_leave", 1, lambda c, t: responses_stream(c, t, leave=True)),
    ("background", 1, background),
    ("background_cancel", 1, lambda c, t: background(c, t, cancel=True)),
    ("stored_chain", 1, stored_chain),
    ("chat_stream", 2, chat_stream),
    ("chat_stream_leave", 1, lambda c, t: chat_stream(c, t, leave=True)),
    ("completions", 2, completions),
    ("websocket", 1, websocket_turns),
    ("websocket_leave", 0.5, lambda c, t: websocket_turns(c, t, leave=True)),
]


async def run_one(ctx: Ctx, t0: float) -> None:
    name, _, action = ctx.rng.choices(ACTIONS, weights=[w for _, w, _ in ACTIONS])[0]
    tier = ctx.rng.choice(TIERS)
    start = time.perf_counter()
    try:
        out = await action(ctx, tier)
    except Exception as e:  # a transport error or a timeout is an error of the run
        out = Outcome(False, None, f"{type(e).__name__}: {e}"[:300])
    ctx.records.append(
        {
            "t": start - t0,
            "kind": name,
            "tier": tier,
            "latency_s": time.perf_counter() - start,
            "ok": out.ok,
            "status": out.status,
            "error": out.error,
        }
    )


async def client_loop(ctx: Ctx, t0: float, deadline: float) -> None:
    while time.perf_counter() < deadline:
        await run_one(ctx, t0)


async def sampler(server: ServerProcess, t0: float, deadline: float, every: float) -> list:
    samples = []
    # a new connection per sample: a kept-alive one idle for the server's keep-alive timeout
    # (5 s, the sampling period) races its close, which is the client's problem, not /health's
    fresh = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=fresh) as http:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            error = None
            try:
                r = await http.get("/health")
                ok, error = r.status_code == 200, None if r.status_code == 200 else r.status_code
            except httpx.HTTPError as e:
                ok, error = False, type(e).__name__
            health = time.perf_counter() - start
            samples.append(
                {
                    "t": start - t0,
                    "rss_mb": server.rss_mb(),
                    "health_s": health,
                    "health_ok": ok,
                    "health_error": error,
                }
            )
            await asyncio.sleep(max(0.0, every - health))
    return samples


async def workload(server: ServerProcess, args) -> tuple[list[dict], list[dict]]:
    t0 = time.perf_counter()
    deadline = t0 + args.minutes * 60
    limits = httpx.Limits(max_connections=args.clients * 2)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
        ctxs = [
            Ctx(server, http, random.Random(args.seed * 1000 + i), args.max_tokens)
            for i in range(args.clients)
        ]
        sampling = asyncio.create_task(sampler(server, t0, deadline, args.sample_seconds))
        clients = [asyncio.create_task(client_loop(c, t0, deadline)) for c in ctxs]
        # Every action is bounded by its timeouts; this bounds the stragglers once more.
        await asyncio.wait(clients, timeout=args.minutes * 60 + 300)
        for task in clients:
            task.cancel()
        samples = await sampling
    return [r for c in ctxs for r in c.records], samples


# -- the report -------------------------------------------------------------------------------


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x."""
    if len(points) < 2:
        return None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else None


def _nearest(samples: list[dict], t: float) -> float | None:
    usable = [s for s in samples if s["rss_mb"] is not None]
    return min(usable, key=lambda s: abs(s["t"] - t))["rss_mb"] if usable else None


def rss_summary(samples: list[dict], warmup_s: float) -> dict:
    after = [
        (s["t"] / 60, s["rss_mb"])
        for s in samples
        if s["t"] >= warmup_s and s["rss_mb"] is not None
    ]
    mean = statistics.fmean(y for _, y in after) if after else None
    deviation = max(abs(y - mean) / mean * 100 for _, y in after) if after else None
    return {
        "rss_start_mb": _nearest(samples, 0),
        "rss_at_warmup_mb": _nearest(samples, warmup_s),
        "rss_end_mb": _nearest(samples, samples[-1]["t"]) if samples else None,
        "rss_max_mb": max((s["rss_mb"] or 0 for s in samples), default=None),
        "rss_post_warmup_mean_mb": mean,
        "rss_slope_mb_per_min": slope(after),
        "rss_max_deviation_pct": deviation,
        "rss_samples_after_warmup": len(after),
    }


def per_minute(records: list[dict]) -> list[dict]:
    minutes: dict[int, list[dict]] = {}
    for r in records:
        minutes.setdefault(int(r["t"] // 60), []).append(r)
    rows = []
    for m in sorted(minutes):
        lat = [r["latency_s"] for r in minutes[m]]
        rows.append(
            {
                "minute": m + 1,
                "requests": len(lat),
                "errors": sum(not r["ok"] for r in minutes[m]),
                "p50_s": percentile(lat, 50),
                "p99_s": percentile(lat, 99),
            }
        )
    return rows


def per_kind(records: list[dict]) -> dict:
    kinds: dict[str, list[dict]] = {}
    for r in records:
        kinds.setdefault(r["kind"], []).append(r)
    return {
        k: {
            "requests": len(v),
            "errors": sum(not r["ok"] for r in v),
            "p50_s": percentile([r["latency_s"] for r in v], 50),
            "p99_s": percentile([r["latency_s"] for r in v], 99),
        }
        for k, v in sorted(kinds.items())
    }


def summarize(records: list[dict], samples: list[dict], args, warmup_s: float) -> dict:
    minutes = per_minute(records)
    # The last minute is the last full one (a partial tail minute has few requests).
    full = [m for m in minutes if m["minute"] <= int(args.minutes)] or minutes
    second = next((m for m in full if m["minute"] == 2), None)
    last = full[-1] if full else None
    ratio = (last["p99_s"] / second["p99_s"]) if second and last and second["p99_s"] else None
    rss = rss_summary(samples, warmup_s)
    errors = [r for r in records if not r["ok"]]
    health = [s["health_s"] for s in samples]
    return {
        **rss,
        "requests": len(records),
        "errors": len(errors),
        "error_examples": [
            {k: r[k] for k in ("t", "kind", "tier", "status", "error")} for r in errors[:20]
        ],
        "p99_second_minute_s": second["p99_s"] if second else None,
        "p99_last_minute_s": last["p99_s"] if last else None,
        "p99_last_over_second": ratio,
        "health_max_s": max(health, default=None),
        "health_failures": sum(not s["health_ok"] for s in samples),
        "per_minute": minutes,
        "per_kind": per_kind(records),
        "acceptance": {
            "rss_within_5pct_after_warmup": None
            if rss["rss_max_deviation_pct"] is None
            else rss["rss_max_deviation_pct"] <= 5,
            "zero_errors": not errors,
            "last_p99_within_20pct_of_second": None if ratio is None else ratio <= 1.2,
        },
    }


def _fmt(value, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def print_summary(s: dict) -> None:
    health = _fmt(s["health_max_s"], ".3f")
    print(f"requests {s['requests']}, errors {s['errors']}, /health max {health} s")
    print(
        f"RSS: start {_fmt(s['rss_start_mb'])} MB, "
        f"after warm-up {_fmt(s['rss_at_warmup_mb'])} MB, "
        f"end {_fmt(s['rss_end_mb'])} MB; slope after warm-up "
        f"{_fmt(s['rss_slope_mb_per_min'], '.2f')} MB/min, max deviation from the mean "
        f"{_fmt(s['rss_max_deviation_pct'], '.2f')}%"
    )
    for m in s["per_minute"]:
        print(
            f"  minute {m['minute']:>3}: {m['requests']:>5} requests, {m['errors']} errors, "
            f"p50 {_fmt(m['p50_s'], '.3f')} s, p99 {_fmt(m['p99_s'], '.3f')} s"
        )
    print(f"p99 last minute / second minute: {_fmt(s['p99_last_over_second'], '.2f')}")
    for e in s["error_examples"][:5]:
        print(f"  error: {e}")
    for name, ok in s["acceptance"].items():
        print(f"  {'n/a ' if ok is None else 'PASS' if ok else 'FAIL'} {name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--warmup-minutes", type=float, default=2)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--sample-seconds", type=float, default=5)
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    warmup_s = min(args.warmup_minutes, args.minutes / 2) * 60
    server = ServerProcess(args.model).start()
    try:
        records, samples = asyncio.run(workload(server, args))
        log_errors = server.log_errors()
        alive = server.alive()
    finally:
        exit_code = server.stop()
    from common import machine, save_results

    summary = summarize(records, samples, args, warmup_s)
    summary.update(
        server_alive_at_end=alive,
        server_exit_code=exit_code,
        server_log_errors=len(log_errors),
        server_log_error_lines=log_errors[:20],
    )
    results = {
        "args": vars(args),
        "warmup_s": warmup_s,
        "model": server.model,
        "machine": machine(),
        "summary": summary,
        "samples": samples,
        "records": records,
    }
    out = save_results("soak-" + time.strftime("%Y%m%d-%H%M%S"), results)
    print_summary(summary)
    print(f"server log errors {len(log_errors)}; exit code {exit_code}; results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
