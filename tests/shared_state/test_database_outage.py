"""A server whose PostgreSQL goes away: requests answer 503 `database_unavailable` with
Retry-After (nothing done, safe to retry), the server stays up, and once the database is back
the next request is served on a new connection; an open WebSocket gets an error event and stays
open. A PostgreSQL server of its own, crashed and
started again by the test; the client is the official openai SDK."""

from __future__ import annotations

import httpx
import openai
import pytest

from expresslane.server.app import create_app
from expresslane.server.database import connect
from expresslane.server.keys import KeyStore, Plan
from expresslane.server.settings import ServerSettings
from tests.postgres import running_cluster
from tests.server.conftest import ServerThread

PROMPT = [{"role": "user", "content": "Say hi."}]
ANSWERED = ("response.completed", "response.incomplete")  # (incomplete: max_output_tokens)


@pytest.fixture(scope="module")
def served():
    from expresslane.config import EngineConfig
    from expresslane.engine.async_engine import AsyncEngine
    from expresslane.engine.engine import LLMEngine

    with running_cluster() as cluster:
        plan = Plan(tiers=["default"], limits={"default": {"rpm": 1000}})  # takes hit the DB
        _, secret = KeyStore(connect(cluster.url)).create("k", plan)
        engine = AsyncEngine(LLMEngine(EngineConfig(calibrate=False, num_kv_blocks=128, seed=0)))
        settings = ServerSettings(database=cluster.url, served_model_name="demo")
        try:
            with ServerThread(create_app(engine, settings)) as server:
                yield cluster, server, secret
        finally:
            engine.shutdown()


def ask(server, secret):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=secret, max_retries=0)
    return c.chat.completions.create(model="demo", messages=PROMPT, max_tokens=2)


def test_an_outage_is_a_retryable_503_and_the_server_recovers(served):
    cluster, server, secret = served
    assert ask(server, secret).usage.completion_tokens > 0
    cluster.crash()
    try:
        for _ in range(2):  # the lost connection, then a refused new one
            with pytest.raises(openai.APIStatusError) as err:
                ask(server, secret)
            assert err.value.status_code == 503
            assert err.value.body["code"] == "database_unavailable"
            assert err.value.response.headers["retry-after"] == "1"
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        cluster.start_again()
    assert ask(server, secret).usage.completion_tokens > 0


def _ws_answer(conn) -> object:
    conn.response.create(model="demo", input="Say hi.", max_output_tokens=2, store=False)
    for event in conn:
        if event.type in ("response.completed", "response.incomplete", "error"):
            return event


def test_an_open_websocket_gets_an_error_event_and_stays_open(served):
    cluster, server, secret = served
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=secret, max_retries=0)
    with c.responses.connect() as conn:
        assert _ws_answer(conn).type in ANSWERED
        cluster.crash()
        try:
            event = _ws_answer(conn)
            assert event.type == "error" and event.error.code == "database_unavailable"
        finally:
            cluster.start_again()
        assert _ws_answer(conn).type in ANSWERED  # on the same connection
