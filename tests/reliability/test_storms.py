"""Storms against a real server: many clients leaving mid-stream, a burst far beyond what the
server holds, and poison requests beside good streams. Afterwards nothing may be left behind:
no request running or queued, every KV block free (`engine.engine.kv`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random

import httpx
import pytest
import websockets

from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from ..server.conftest import ServerThread
from .conftest import MODEL, TERMINAL, error_shape_problem, sse_server_errors, wait_idle

TIERS = ["ultrafast", "default", "flex"]


def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/responses"


def request_for(kind: str, i: int, tokens: int, tier: str) -> tuple[str, dict]:
    """(path, body) of a correct request of `kind` that generates exactly `tokens` tokens."""
    common = {"model": MODEL, "ignore_eos": True, "service_tier": tier}
    if kind == "chat":
        messages = [{"role": "user", "content": f"client {i}"}]
        return "/v1/chat/completions", {**common, "messages": messages, "max_tokens": tokens}
    if kind == "completions":
        return "/v1/completions", {**common, "prompt": f"client {i}", "max_tokens": tokens}
    return "/v1/responses", {**common, "input": f"client {i}", "max_output_tokens": tokens}


async def leave_sse(http: httpx.AsyncClient, path: str, body: dict, after: int) -> None:
    """Stream `body` and leave after `after` data lines (the connection closes here)."""
    seen = 0
    async with http.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code == 429:  # the lane's queue is full: shed, nothing to leave
            assert r.headers["retry-after"], await r.aread()
            return
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen >= after:
                    return


async def leave_ws(server, body: dict, after: int) -> None:
    async with websockets.connect(ws_url(server)) as ws:
        await ws.send(json.dumps({"type": "response.create", **body}))
        for _ in range(after):
            event = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if event["type"] in TERMINAL or event["type"] == "error":
                return


async def leave_plain(http: httpx.AsyncClient, path: str, body: dict, after: int) -> None:
    with contextlib.suppress(httpx.TimeoutException):
        await http.post(path, json=body, timeout=0.05 * after)


async def test_disconnect_storm_leaves_every_kv_block_free(server, engine):
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        clients = []
        for i in range(50):
            kind = rng.choice(["responses", "chat", "completions", "ws", "plain"])
            path, body = request_for(
                "responses" if kind in ("ws", "plain") else kind, i, 300, rng.choice(TIERS)
            )
            after = rng.randint(1, 30)
            if kind == "ws":
                clients.append(leave_ws(server, body, after))
            elif kind == "plain":
                clients.append(leave_plain(http, path, body, after))
            else:
                clients.append(leave_sse(http, path, body, after))
        await asyncio.gather(*clients)
        await asyncio.to_thread(wait_idle, server.url, engine)
        assert engine.engine.kv.num_free_blocks == engine.engine.kv.num_blocks
        after = await http.post("/v1/responses", json=request_for("responses", 0, 4, "flex")[1])
        assert after.status_code == 200 and after.json()["usage"]["output_tokens"] == 4


async def poll_health(http: httpx.AsyncClient, stop: asyncio.Event, answers: list) -> None:
    while not stop.is_set():
        try:
            answers.append((await http.get("/health", timeout=30)).status_code)
        except httpx.HTTPError as e:  # no answer within 30 s counts as down
            answers.append(repr(e))
        await asyncio.sleep(0.1)


def check_burst_answer(r: httpx.Response) -> str | None:
    """None if `r` is a served request or a 429 that says when to come back."""
    if r.status_code == 200:
        errors = sse_server_errors(r.text)
        return f"a stream failed inside: {errors[:1]}" if errors else None
    if r.status_code != 429:
        return f"{r.status_code} {r.text[:200]}"
    problem = error_shape_problem(r.json())
    if problem:
        return problem
    if "retry-after" not in r.headers or not any(h.startswith("x-ratelimit-") for h in r.headers):
        return f"429 without Retry-After or x-ratelimit-* headers: {dict(r.headers)}"
    return None


@pytest.fixture(scope="module")
def short_queue_server(engine):
    """The same engine behind a server whose lanes queue nothing beyond their max batch."""
    settings = ServerSettings(store_path=":memory:", served_model_name=MODEL, max_queued_per_lane=0)
    with ServerThread(create_app(engine, settings)) as s:
        yield s


@pytest.mark.parametrize("queues", ["default", "none"])
async def test_overload_burst_is_served_or_shed_and_health_answers(
    server, short_queue_server, engine, queues
):
    """200 requests at once (more than the lanes' batches hold): each is served or gets 429
    with Retry-After, none hangs (each bounded by a 120 s client timeout), /health answers.
    With no queue beyond the batches, some are shed."""
    srv = server if queues == "default" else short_queue_server
    limits = httpx.Limits(max_connections=260, max_keepalive_connections=260)
    async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as http:
        stop, health = asyncio.Event(), []
        poller = asyncio.create_task(poll_health(http, stop, health))

        async def one(i: int) -> httpx.Response:
            kind = ["responses", "chat", "completions"][i % 3]
            path, body = request_for(kind, i, 64, TIERS[i % 3])
            return await http.post(path, json={**body, "stream": i % 2 == 0})

        answers = await asyncio.gather(*(one(i) for i in range(200)), return_exceptions=True)
        stop.set()
        await poller
    hung = [repr(a) for a in answers if isinstance(a, BaseException)]
    assert not hung, hung[:5]
    problems = [p for p in map(check_burst_answer, answers) if p]
    assert not problems, problems[:5]
    assert health and all(h == 200 for h in health), [h for h in health if h != 200][:5]
    if queues == "none":
        assert any(a.status_code == 429 for a in answers)
    await asyncio.to_thread(wait_idle, srv.url, engine)
    assert engine.engine.kv.num_free_blocks == engine.engine.kv.num_blocks


POISON = [
    {"seed": 2**64, "temperature": 1.0},
    {"seed": 10**100, "temperature": 1.0},
    {"top_k": 2**63, "temperature": 1.0},
]


async def stream_text(http: httpx.AsyncClient, body: dict) -> tuple[str, list[str], str]:
    """(status of the final response, server errors seen, text) of one Responses stream."""
    text, status = [], None
    async with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        raw = []
        async for line in r.aiter_lines():
            raw.append(line)
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event["type"] == "response.output_text.delta":
                    text.append(event["delta"])
                if event["type"] in TERMINAL:
                    status = event["response"]["status"]
    return status, sse_server_errors("\n".join(raw)), "".join(text)


async def test_poison_requests_leave_good_streams_of_every_tier_unchanged(server, engine):
    good = {tier: {**request_for("responses", 7, 200, tier)[1], "temperature": 0} for tier in TIERS}
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        solo = {tier: await stream_text(http, body) for tier, body in good.items()}
        streams = [asyncio.create_task(stream_text(http, body)) for body in good.values()]
        await asyncio.sleep(0.05)
        poison = []
        for bad in POISON:
            for kind in ("responses", "chat", "completions"):
                path, body = request_for(kind, 0, 8, "default")
                poison.append(http.post(path, json={**body, **bad}))
        poisoned = await asyncio.gather(*poison)
        together = dict(zip(TIERS, await asyncio.gather(*streams)))
    assert together == solo, {t: (together[t][:2], solo[t][:2]) for t in TIERS}
    # Each poison request is refused (4xx) or, if its value is bounded, served; never a 5xx.
    wrong = [
        (r.request.content[-60:], r.status_code, r.text[:200])
        for r in poisoned
        if r.status_code >= 500 or (r.status_code >= 400 and error_shape_problem(r.json()))
    ]
    assert not wrong, wrong
    await asyncio.to_thread(wait_idle, server.url, engine)
