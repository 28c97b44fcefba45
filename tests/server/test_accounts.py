"""API keys, tier entitlement, lane capacity policies, rate limits, quota and metering, through
the official openai SDK against a real server with a real SQLite accounts database. Keys are
made with the `expresslane keys` command."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import threading

import httpx
import openai
import pytest
import websockets

from expresslane.cli import main as cli
from expresslane.config import EngineConfig
from expresslane.engine.async_engine import AsyncEngine
from expresslane.engine.engine import LLMEngine
from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from .conftest import ServerThread

NO_EOS = {"ignore_eos": True}


def run_cli(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli(list(args)) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("accounts") / "accounts.sqlite")


@pytest.fixture(scope="module")
def keys(db) -> dict[str, str]:
    plans = {
        "basic": ["--tiers", "default,flex"],
        "fast": ["--tiers", "ultrafast,default", "--when-unavailable", "reject"],
        "fast_down": ["--tiers", "ultrafast,default", "--when-unavailable", "downgrade"],
        "down": ["--tiers", "default", "--when-unavailable", "downgrade"],
        "rpm": ["--tiers", "default", "--rpm", "2"],
        "tpm": ["--tiers", "default", "--limit", "default:tpm=120"],
        "quota": ["--tiers", "default", "--monthly-tokens", "30"],
        "stream": ["--tiers", "default", "--rpm", "100"],
        "ledger": ["--tiers", "default,flex"],
        "meter": ["--tiers", "ultrafast,default,flex", "--default-tier", "default"],
    }
    return {
        name: json.loads(run_cli("keys", "create", name, *flags, "--json", "--db", db))["key"]
        for name, flags in plans.items()
    }


@pytest.fixture(scope="module")
def server(llama_dir, db, keys):
    lanes = {"ultrafast": {"max_batch": 1}}
    engine = AsyncEngine(
        LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=512, seed=0, lanes=lanes))
    )
    settings = ServerSettings(store_path=":memory:", accounts_path=db)
    with ServerThread(create_app(engine, settings)) as s:
        yield s
    engine.shutdown()


def client(server, key: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=retries)


def complete(c: openai.OpenAI, tokens: int = 3, tier: str | None = None, prompt=None):
    return c.completions.with_raw_response.create(
        model="llama",
        prompt=prompt or [5, 6, 7, 8, 9],
        max_tokens=tokens,
        extra_body={**NO_EOS, **({"service_tier": tier} if tier else {})},
    )


def ledger(db: str) -> list[dict]:
    from expresslane.server.keys import connect
    from expresslane.server.metering import Ledger

    return Ledger(connect(db)).rows()


def test_missing_wrong_and_revoked_keys_get_401(server, db, keys):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert "Authorization: Bearer" in r.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        complete(client(server, "el-not-a-key"))
    assert httpx.get(server.url + "/health").status_code == 200  # not behind a key
    secret = json.loads(run_cli("keys", "create", "temp", "--json", "--db", db))["key"]
    complete(client(server, secret))
    assert "revoked 1" in run_cli("keys", "revoke", "temp", "--db", db)
    with pytest.raises(openai.AuthenticationError):
        complete(client(server, secret))


def test_a_tier_the_key_lacks_is_403_naming_it(server, keys):
    with pytest.raises(openai.PermissionDeniedError) as e:
        complete(client(server, keys["basic"]), tier="priority")
    assert "'ultrafast'" in e.value.message
    assert e.value.code == "tier_not_allowed"


def test_downgrade_and_auto_are_echoed(server, keys):
    r = client(server, keys["down"]).responses.create(
        model="llama", input="hi", max_output_tokens=2, service_tier="ultrafast"
    )
    assert r.service_tier == "default"
    r = client(server, keys["fast"]).chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert r.service_tier == "ultrafast"  # "auto": the key's default tier (its first)
    r = client(server, keys["basic"]).chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        service_tier="flex",
    )
    assert r.service_tier == "flex"


def test_requests_per_minute_429_with_retry_headers(server, keys):
    c = client(server, keys["rpm"])
    first = complete(c)
    h = first.headers
    assert h["x-ratelimit-limit-requests"] == "2"
    assert h["x-ratelimit-remaining-requests"] == "1"
    assert h["x-ratelimit-reset-requests"].endswith("s")
    second = complete(c)
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(openai.RateLimitError) as e:
        complete(c)
    h = e.value.response.headers
    assert int(h["retry-after"]) >= 1
    assert float(h["retry-after-ms"]) > 0
    assert h["x-ratelimit-remaining-requests"] == "0"
    assert e.value.code == "rate_limit_exceeded"
    assert "requests per minute" in e.value.message


def test_tokens_per_minute_and_the_sdk_retry(server, keys):
    c = client(server, keys["tpm"])
    # 5 prompt + 115 output tokens: the whole minute's 120
    r = complete(c, tokens=115)
    assert r.headers["x-ratelimit-limit-tokens"] == "120"
    assert r.headers["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(openai.RateLimitError) as e:
        complete(c, tokens=1)
    wait_ms = float(e.value.response.headers["retry-after-ms"])
    assert 0 < wait_ms <= 10_000  # 6 tokens at 2 tokens/s
    # the SDK waits as told and then gets through
    ok = complete(client(server, keys["tpm"], retries=3), tokens=1)
    assert ok.parse().choices[0].finish_reason == "length"


def test_streamed_responses_carry_the_headers(server, keys):
    headers = {"authorization": f"Bearer {keys['stream']}"}
    body = {"model": "llama", "prompt": [1, 2, 3], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        assert r.headers["x-ratelimit-limit-requests"] == "100"
        assert r.headers["x-ratelimit-remaining-requests"] == "99"
        assert "data: [DONE]" in r.read().decode()


def test_monthly_quota_is_429_insufficient_quota_and_not_retried(server, keys):
    c = client(server, keys["quota"], retries=2)
    complete(c, tokens=30)  # 35 tokens: over the 30-token quota
    with pytest.raises(openai.RateLimitError) as e:
        complete(c)
    assert e.value.code == "insufficient_quota"
    assert e.value.response.headers["x-should-retry"] == "false"


def test_ledger_rows_with_cost_and_cancellations(server, db, keys):
    c = client(server, keys["meter"])
    complete(c, tokens=4, tier="ultrafast", prompt=[9, 8, 7, 6])
    stream = c.completions.create(
        model="llama", prompt=[3, 4, 5], max_tokens=400, stream=True, extra_body=NO_EOS
    )
    next(iter(stream))
    stream.close()  # the client goes away: the request is cancelled
    meter_id = json.loads(run_cli("keys", "list", "--json", "--db", db))
    meter_id = next(k["id"] for k in meter_id if k["name"] == "meter")
    for _ in range(100):  # the cancellation is written when the server notices
        rows = [r for r in ledger(db) if r["key_id"] == meter_id]
        if len(rows) == 2:
            break
        threading.Event().wait(0.05)
    fast, cancelled = sorted(rows, key=lambda r: r["status"] == "abort")
    assert (fast["tier_requested"], fast["tier_served"]) == ("ultrafast", "ultrafast")
    assert (fast["input_tokens"], fast["output_tokens"], fast["status"]) == (4, 4, "length")
    # default prices: 0.10 in / 0.40 out per 1M tokens, ultrafast 6x
    assert fast["cost"] == pytest.approx((4 * 0.10 + 4 * 0.40) / 1e6 * 6)
    assert fast["ttft_s"] > 0 and fast["e2e_s"] >= fast["ttft_s"]
    assert cancelled["status"] == "abort"
    assert cancelled["tier_served"] == "default"
    assert 0 < cancelled["output_tokens"] < 400
    usage = json.loads(run_cli("usage", "--json", "--db", db))
    mine = {u["tier"]: u for u in usage if u["key_id"] == meter_id}
    assert mine["ultrafast"]["requests"] == 1
    assert mine["default"]["cancelled"] == 1
    assert "usage per key and tier" in run_cli("usage", "--db", db)


def test_full_ultrafast_lane_rejects_or_downgrades_per_key(server, keys):
    fast = client(server, keys["fast"])
    stream = fast.completions.create(
        model="llama", prompt=[1, 2], max_tokens=500, stream=True, extra_body=NO_EOS
    )
    next(iter(stream))  # the only ultrafast slot is taken for a while
    try:
        r = complete(client(server, keys["fast_down"]), tier="ultrafast")
        assert r.parse().service_tier == "default"
        with pytest.raises(openai.RateLimitError) as e:
            complete(fast, tier="ultrafast")
        assert e.value.code == "tier_at_capacity"
        assert e.value.response.headers["retry-after"] == "1"
    finally:
        stream.close()


def test_websocket_needs_a_key_and_checks_tiers(server, keys):
    url = server.url.replace("http", "ws") + "/v1/responses"

    async def scenario():
        with pytest.raises(websockets.exceptions.InvalidStatus) as e:
            async with websockets.connect(url):
                pass
        assert e.value.response.status_code == 401
        headers = {"Authorization": f"Bearer {keys['basic']}"}
        async with websockets.connect(url, additional_headers=headers) as ws:
            create = {"type": "response.create", "model": "llama", "input": "hi"}
            await ws.send(json.dumps({**create, "service_tier": "ultrafast"}))
            err = json.loads(await ws.recv())
            assert err["type"] == "error" and err["status"] == 403
            await ws.send(json.dumps({**create, "max_output_tokens": 2}))
            done = ("response.completed", "response.incomplete", "error")
            while (event := json.loads(await ws.recv()))["type"] not in done:
                pass
            assert event["response"]["service_tier"] == "default"

    asyncio.run(scenario())


def test_ledger_totals_equal_the_usage_clients_were_given(server, db, keys):
    c = client(server, keys["ledger"])
    given = []  # (input, output) as each client saw it
    chat = c.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "hello"}], max_tokens=5, n=2
    )
    given.append((chat.usage.prompt_tokens, chat.usage.completion_tokens))
    chunks = list(
        c.completions.create(
            model="llama",
            prompt=[4, 5, 6],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    given.append((chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens))
    r = c.responses.create(model="llama", input="hi", max_output_tokens=4, service_tier="flex")
    given.append((r.usage.input_tokens, r.usage.output_tokens))
    bg = c.responses.create(
        model="llama",
        input="a long one",
        max_output_tokens=400,
        background=True,
        extra_body=NO_EOS,
    )
    for _ in range(200):  # cancel once it has produced something
        if c.responses.retrieve(bg.id).status == "in_progress":
            break
        threading.Event().wait(0.01)
    cancelled = c.responses.cancel(bg.id)
    for _ in range(200):
        cancelled = c.responses.retrieve(bg.id)
        if cancelled.status == "cancelled":
            break
        threading.Event().wait(0.02)
    assert cancelled.status == "cancelled" and cancelled.usage is not None
    given.append((cancelled.usage.input_tokens, cancelled.usage.output_tokens))
    key_id = next(
        k["id"]
        for k in json.loads(run_cli("keys", "list", "--json", "--db", db))
        if k["name"] == "ledger"
    )
    rows = [r for r in ledger(db) if r["key_id"] == key_id]
    assert len(rows) == 5  # n=2 chat counts twice
    assert sum(r["input_tokens"] for r in rows) == sum(i for i, _ in given)
    assert sum(r["output_tokens"] for r in rows) == sum(o for _, o in given)
    assert {r["status"] for r in rows} >= {"abort", "length"}
