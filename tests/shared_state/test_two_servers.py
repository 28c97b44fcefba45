"""Two ingress servers sharing one PostgreSQL database, as a fleet's are: keys made with
`expresslane keys --database` work on both, the ledger adds up to the usage clients were told,
a requests/min limit holds across both together, and a response stored through one is read
and continued through the other, by its owner only. The clients are the official openai SDK,
sending to the two servers in turn; the model is the bundled demo model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import openai
import pytest

from expresslane.server.app import create_app
from expresslane.server.database import connect
from expresslane.server.metering import Ledger
from expresslane.server.settings import ServerSettings
from tests.postgres import drop_database, new_database
from tests.server.conftest import ServerThread

MODEL = "demo"
CLI = os.path.join(os.path.dirname(sys.executable), "expresslane")  # pip install -e made it
SHORT = {"max_tokens": 4, "extra_body": {"ignore_eos": True}}


def expresslane(*args: str) -> str:
    """Run the `expresslane` command in a subprocess; its stdout."""
    done = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def database(postgres_url):
    url = new_database(postgres_url)
    yield url
    drop_database(url)


@pytest.fixture(scope="module")
def keys(database) -> dict[str, str]:
    plans = {"alice": [], "bob": [], "limited": ["--rpm", "6"], "temp": []}
    made = {}
    for name, flags in plans.items():
        out = expresslane("keys", "create", name, *flags, "--json", "--database", database)
        made[name] = json.loads(out)["key"]
    return made


@pytest.fixture(scope="module")
def servers(database, keys):
    from expresslane.config import EngineConfig
    from expresslane.engine.async_engine import AsyncEngine
    from expresslane.engine.engine import LLMEngine

    engine = AsyncEngine(LLMEngine(EngineConfig(calibrate=False, num_kv_blocks=512, seed=0)))
    settings = ServerSettings(database=database, served_model_name=MODEL)
    try:
        with (
            ServerThread(create_app(engine, settings)) as a,
            ServerThread(create_app(engine, settings)) as b,
        ):
            yield a, b
    finally:
        engine.shutdown()


def sdk(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def ledger_rows(database: str, key_id: str, want: int) -> list[dict]:
    """The key's ledger rows, once there are `want` of them (written as requests end)."""
    deadline = time.monotonic() + 30
    while True:
        rows = [r for r in Ledger(connect(database)).rows() if r["key_id"] == key_id]
        if len(rows) >= want or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


def key_id(database: str, name: str) -> str:
    listed = json.loads(expresslane("keys", "list", "--json", "--database", database))
    return next(k["id"] for k in listed if k["name"] == name and k["revoked_at"] is None)


def test_the_ledger_adds_up_to_the_usage_both_servers_reported(servers, keys, database):
    told = []
    for i in range(6):
        c = sdk(servers[i % 2], keys["alice"])
        if i % 3 == 0:
            r = c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}], **SHORT
            )
            told.append((r.usage.prompt_tokens, r.usage.completion_tokens))
        elif i % 3 == 1:
            r = c.completions.create(model=MODEL, prompt=f"count {i}", **SHORT)
            told.append((r.usage.prompt_tokens, r.usage.completion_tokens))
        else:
            r = c.responses.create(model=MODEL, input=f"say {i}", max_output_tokens=4)
            told.append((r.usage.input_tokens, r.usage.output_tokens))
    rows = ledger_rows(database, key_id(database, "alice"), len(told))
    assert len(rows) == len(told)
    assert sum(r["input_tokens"] for r in rows) == sum(t[0] for t in told)
    assert sum(r["output_tokens"] for r in rows) == sum(t[1] for t in told)
    usage = json.loads(expresslane("usage", "--json", "--database", database))
    mine = [u for u in usage if u["key_id"] == rows[0]["key_id"]]
    assert sum(u["requests"] for u in mine) == len(told)
    assert sum(u["output_tokens"] for u in mine) == sum(t[1] for t in told)
    assert sum(u["cost"] for u in mine) == pytest.approx(sum(r["cost"] for r in rows))


def test_a_requests_per_minute_limit_holds_across_both_servers(servers, keys):
    ok, refused = 0, []
    for i in range(12):
        try:
            sdk(servers[i % 2], keys["limited"]).completions.create(
                model=MODEL, prompt="x", **SHORT
            )
            ok += 1
        except openai.RateLimitError as e:
            refused.append(e)
    assert 6 <= ok <= 7  # 6 per minute; at most one more refills while the test runs
    assert len(refused) == 12 - ok
    for e in refused:
        assert e.code == "rate_limit_exceeded" and e.type == "requests"
        h = e.response.headers
        assert int(h["retry-after"]) >= 1 and int(h["retry-after-ms"]) >= 1
        assert h["x-ratelimit-limit-requests"] == "6"
        assert h["x-ratelimit-remaining-requests"] == "0"


def test_a_response_stored_through_one_server_is_read_through_the_other(servers, keys):
    a, b = servers
    first = sdk(a, keys["alice"]).responses.create(
        model=MODEL, input="remember this", max_output_tokens=4
    )
    assert sdk(b, keys["alice"]).responses.retrieve(first.id).output_text == first.output_text
    follow = sdk(b, keys["alice"]).responses.create(
        model=MODEL, input="and then?", previous_response_id=first.id, max_output_tokens=4
    )
    assert follow.previous_response_id == first.id
    assert sdk(a, keys["alice"]).responses.retrieve(follow.id).status == follow.status
    with pytest.raises(openai.NotFoundError):
        sdk(b, keys["bob"]).responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        sdk(a, keys["bob"]).responses.create(
            model=MODEL, input="x", previous_response_id=first.id, max_output_tokens=4
        )
    assert e.value.code == "previous_response_not_found"


def test_a_key_revoked_on_the_command_line_is_refused_by_both(servers, keys, database):
    for s in servers:
        sdk(s, keys["temp"]).completions.create(model=MODEL, prompt="x", **SHORT)
    assert "revoked 1" in expresslane("keys", "revoke", "temp", "--database", database)
    for s in servers:
        with pytest.raises(openai.AuthenticationError):
            sdk(s, keys["temp"]).completions.create(model=MODEL, prompt="x", **SHORT)
    listed = json.loads(expresslane("keys", "list", "--json", "--database", database))
    assert {k["name"]: k["revoked_at"] is not None for k in listed}["temp"]
