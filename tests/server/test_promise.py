"""The ultrafast promise through a real server, with real keys and the openai SDK: published at
/v1/tiers, kept by admission (a request the lane cannot take is refused or downgraded at once,
per its key's policy, and says which tier served it), judged per request and billed as
served (a missed promise is billed at the default price, its refund in the ledger), reported
by /metrics and `expresslane usage --promise`.

The engine's step-latency model is given known costs (10 ms + 10 ms per sequence: two
ultrafast requests decode at 31.7 tokens/s each under "auto", three at 23.75), so that a
promise of 30 tokens/s has room for two, whatever this machine's speed."""

from __future__ import annotations

import dataclasses
import json

import httpx
import openai
import pytest

from expresslane.cli import main as cli
from expresslane.engine.async_engine import AsyncEngine
from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from .conftest import ServerThread, known_costs_engine
from .test_accounts import ledger, run_cli

LANES = {
    "ultrafast": {
        "max_batch": 4,
        "speculative": False,
        "promise": {"tokens_per_s": 30.0, "ttft_s": 5.0},
    }
}
FOREVER = {"ignore_eos": True}  # with max_tokens near the context: runs until closed
OPERATOR = "op-secret"  # `serve --api-key`: sees /metrics per key


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("promise") / "accounts.sqlite")


@pytest.fixture(scope="module")
def keys(db) -> dict[str, str]:
    plans = {
        "reject": ["--when-unavailable", "reject"],
        "down": ["--when-unavailable", "downgrade"],
        "bill": ["--when-unavailable", "reject"],
    }
    both = ["--tiers", "ultrafast,default", "--default-tier", "ultrafast"]
    return {
        name: json.loads(run_cli("keys", "create", name, *both, *flags, "--json", "--db", db))[
            "key"
        ]
        for name, flags in plans.items()
    }


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = known_costs_engine(tmp_path_factory.mktemp("long"), LANES)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine, db, keys):
    settings = ServerSettings(store_path=":memory:", accounts_path=db, api_key=OPERATOR)
    with ServerThread(create_app(engine, settings)) as s:
        yield s


def sdk(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def key_id(db: str, name: str) -> str:
    keys = json.loads(run_cli("keys", "list", "--json", "--db", db))
    return next(k["id"] for k in keys if k["name"] == name)


def promise_as(engine: AsyncEngine, **values) -> None:
    """State the ultrafast promise anew (what the next requests are judged by)."""
    room = engine.engine.scheduler.room
    room.stated["ultrafast"] = dataclasses.replace(room.stated["ultrafast"], **values)


def test_tiers_publish_prices_and_promises(server, keys):
    got = httpx.get(server.url + "/v1/tiers", headers={"authorization": f"Bearer {keys['bill']}"})
    tiers = {t["id"]: t for t in got.json()["data"]}
    fast = tiers["ultrafast"]
    assert fast["aliases"] == ["fast", "priority"] and fast["price_multiplier"] == 6.0
    assert fast["prices_per_1m_tokens"]["output"] == pytest.approx(0.40 * 6)
    promise = fast["promise"]
    assert (promise["tokens_per_s"], promise["floor_tokens_per_s"]) == (30.0, 15.0)
    assert (promise["percentile"], promise["window_s"], promise["ttft_s"]) == (50, 300, 5.0)
    assert promise["measured"] is False
    assert tiers["default"]["promise"] is None and tiers["flex"]["served"]


def test_a_full_lane_refuses_or_downgrades_at_once(server, db, keys):
    running = [
        sdk(server, keys["reject"]).completions.create(
            model="llama", prompt=[5, 6, 7], max_tokens=4000, stream=True, extra_body=FOREVER
        )
        for _ in range(2)
    ]
    try:
        for stream in running:
            next(iter(stream))  # both are decoding
        with pytest.raises(openai.RateLimitError) as e:
            sdk(server, keys["reject"]).completions.create(
                model="llama", prompt=[5, 6], max_tokens=2
            )
        assert e.value.code == "tier_at_capacity"
        assert e.value.response.headers["retry-after"] == "1"
        raw = sdk(server, keys["down"]).completions.with_raw_response.create(
            model="llama", prompt=[5, 6], max_tokens=2
        )
        assert raw.headers["x-expresslane-served-tier"] == "default"
        assert raw.parse().service_tier == "default"
    finally:
        for stream in running:
            stream.close()
    down = [r for r in ledger(db) if r["key_id"] == key_id(db, "down")]
    assert [(r["tier_requested"], r["tier_served"]) for r in down] == [("ultrafast", "default")]
    assert down[0]["promise_kept"] is None  # the default tier promises nothing
    assert down[0]["cost"] == pytest.approx((2 * 0.10 + 2 * 0.40) / 1e6)  # at the default price


def test_served_tier_in_the_header_and_the_stream(server, keys):
    c = sdk(server, keys["bill"])
    raw = c.chat.completions.with_raw_response.create(
        model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert raw.headers["x-expresslane-served-tier"] == "ultrafast"
    assert raw.parse().service_tier == "ultrafast"
    chunks = list(
        c.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
    )
    assert {chunk.service_tier for chunk in chunks} == {"ultrafast"}


def test_missed_promises_are_billed_at_the_default_price(server, engine, db, keys):
    c = sdk(server, keys["bill"])
    cases = [
        ("kept", {"tokens_per_s": 0.01, "ttft_s": 1000.0}),
        ("speed", {"tokens_per_s": 1e9, "ttft_s": 1000.0}),
        ("ttft", {"tokens_per_s": 0.01, "ttft_s": 1e-9}),
    ]
    mine = key_id(db, "bill")
    before = len([r for r in ledger(db) if r["key_id"] == mine])
    for _, promise in cases:
        promise_as(engine, **promise)
        c.completions.create(model="llama", prompt=[3, 4, 5, 6], max_tokens=24, extra_body=FOREVER)
    promise_as(engine, tokens_per_s=30.0, ttft_s=5.0)
    rows = [r for r in ledger(db) if r["key_id"] == mine][before:]
    listed = (4 * 0.10 + 24 * 0.40) / 1e6 * 6  # ultrafast's price, 6x
    kept, speed, ttft = rows
    assert (kept["promise_kept"], kept["refund"], kept["cost"]) == (1, 0.0, pytest.approx(listed))
    for missed in (speed, ttft):
        assert missed["promise_kept"] == 0
        assert missed["cost"] == pytest.approx(listed / 6)  # billed as the default tier
        assert missed["refund"] == pytest.approx(listed * 5 / 6)
        assert missed["delivered_tokens_per_s"] > 0
    assert speed["promised_tokens_per_s"] == 1e9 and ttft["promised_ttft_s"] == 1e-9
    assert sum(r["cost"] + r["refund"] for r in rows) == pytest.approx(3 * listed)

    operator = {"authorization": f"Bearer {OPERATOR}"}
    metrics = httpx.get(server.url + "/metrics", headers=operator).text
    assert 'promise_tokens_per_second{model_name="llama",tier="ultrafast"} 30.0' in metrics
    missed = f'requests_total{{key="{mine}",model_name="llama",outcome="missed",tier="ultrafast"}}'
    assert missed + " 2.0" in metrics
    for tenant in ({}, {"authorization": f"Bearer {keys['bill']}"}):  # summed over keys
        anyone = httpx.get(server.url + "/metrics", headers=tenant).text
        assert 'key="' not in anyone
        assert 'requests_total{model_name="llama",outcome="missed",tier="ultrafast"}' in anyone
    assert 'promise_attainment{model_name="llama",tier="ultrafast"}' in metrics
    windows = json.loads(run_cli("usage", "--promise", "--json", "--db", db))
    judged = [w for w in windows if w["key_id"] == mine]
    assert sum(w["judged"] for w in judged) >= 3 and sum(w["kept"] for w in judged) >= 1
    usage = json.loads(run_cli("usage", "--json", "--db", db))
    usage = {u["tier"]: u for u in usage if u["key_id"] == mine}
    assert usage["ultrafast"]["refund"] > 0
    assert "promise attainment per key" in run_cli("usage", "--promise", "--db", db)


def test_bench_reports_the_promise_from_the_client_side(server, keys, tmp_path):
    out = tmp_path / "bench"
    args = ["bench", "--base-url", server.url, "--api", "chat", "--api-key", keys["bill"]]
    args += ["--concurrency", "2", "--requests", "4", "--input-tokens", "12"]
    args += ["--output-tokens", "20", "--quiet", "--out", str(out)]
    assert cli(args) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["promises"]["ultrafast"]["tokens_per_s"] == 30.0
    fast = data["runs"][0]["summary"]["promises"]["ultrafast"]
    assert fast["requests"] == 4 and fast["promised_tokens_per_s"] == 30.0
    assert fast["kept"] == round(fast["attainment"] * 4)
    assert fast["delivered_tokens_per_s"]["count"] >= 1
    assert "Promises (published at /v1/tiers" in (out / "report.md").read_text()
