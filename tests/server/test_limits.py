"""Input the server refuses before it costs anything, and work it sheds instead of queueing
without bound: every case is a 4xx in the OpenAI error shape, over HTTP and WebSocket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest
import websockets

from expresslane.config import EngineConfig
from expresslane.engine.async_engine import AsyncEngine
from expresslane.engine.engine import LLMEngine
from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from ..conftest import make_checkpoint
from .conftest import ServerThread
from .test_errors import check

JSON = {"content-type": "application/json"}
DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize(
    "path,text",
    [
        ("/v1/responses", '{"input": "x", "temperature": NaN}'),
        ("/v1/responses", '{"input": "x", "top_p": Infinity}'),
        ("/v1/responses", '{"input": "x", "temperature": 1e400}'),
        (
            "/v1/responses",
            '{"input": "x", "tools": [{"type": "function", "name": "f", '
            '"parameters": {"type": "object", "x": NaN}}]}',
        ),
        ("/v1/responses", '{"input": "x", "reasoning": {"effort": -Infinity}}'),
        ("/v1/chat/completions", '{"model": "m", "messages": [], "temperature": NaN}'),
        ("/v1/completions", '{"model": "m", "prompt": "x", "top_p": NaN}'),
    ],
)
def test_non_finite_numbers_are_400(http, path, text):
    err = check(http.post(path, content=text, headers=JSON), 400, code="invalid_json")
    assert "finite" in err["message"] or "too large" in err["message"]


@pytest.mark.parametrize(
    "path,text",
    [
        ("/v1/responses", '{"model": "\\ud800", "input": "x"}'),
        ("/v1/responses", '{"input": "x \\udfff y"}'),
        ("/v1/responses", '{"input": [{"role": "user", "content": "\\ud83d"}]}'),
        ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "\\ud800": 1}]}'),
    ],
)
def test_lone_surrogates_are_400(http, path, text):
    err = check(http.post(path, content=text, headers=JSON), 400, code="invalid_json")
    assert "surrogate" in err["message"]


def test_a_paired_surrogate_is_text(http, model_name):
    body = f'{{"model": "{model_name}", "input": "\\ud83d\\ude00", "max_output_tokens": 1}}'
    r = http.post("/v1/responses", content=body, headers=JSON)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions", "/v1/completions"])
def test_deep_nesting_is_400(http, path):
    body = f'{{"model": "m", "input": {DEEP}, "messages": {DEEP}, "prompt": {DEEP}}}'
    err = check(http.post(path, content=body, headers=JSON), 400, code="invalid_json")
    assert "nest" in err["message"]
    shallow = "[" * 40 + "]" * 40
    err = check(http.post(path, content=f'{{"input": {shallow}}}', headers=JSON), 400)
    assert "nest" in err["message"]


def test_websocket_survives_deep_nesting_and_bad_numbers(server, model_name):
    async def go():
        url = server.url.replace("http", "ws") + "/v1/responses"
        async with websockets.connect(url, max_size=2**24) as ws:
            for text in (DEEP, '{"type": "response.create", "temperature": NaN}'):
                await ws.send(text)
                event = json.loads(await ws.recv())
                assert event["type"] == "error" and event["status"] == 400, event
                assert event["error"]["code"] == "invalid_json"
            await ws.send(
                json.dumps(
                    {
                        "type": "response.create",
                        "model": model_name,
                        "input": "hi",
                        "max_output_tokens": 2,
                    }
                )
            )
            while True:
                event = json.loads(await ws.recv())
                if event["type"] in ("response.completed", "response.incomplete"):
                    return
                assert event["type"] != "error", event

    asyncio.run(go())


def test_too_many_items_and_tools(http, model_name):
    many = [{"role": "user", "content": "x"}] * 5000
    r = http.post("/v1/chat/completions", json={"model": model_name, "messages": many})
    check(r, 400, param="messages", code="too_many_items")
    r = http.post("/v1/responses", json={"model": model_name, "input": many})
    check(r, 400, param="input", code="too_many_items")
    tools = [{"type": "function", "name": f"t{i}"} for i in range(200)]
    r = http.post("/v1/responses", json={"model": model_name, "input": "x", "tools": tools})
    check(r, 400, param="tools", code="too_many_items")
    r = http.post("/v1/completions", json={"model": model_name, "prompt": ["x"] * 5000})
    check(r, 400, param="prompt", code="too_many_items")


def test_huge_prompt_is_refused_before_tokenizing(http, model_name):
    huge = "word " * 2_000_000  # 10 MB
    for path, body in (
        ("/v1/responses", {"input": huge}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
        ("/v1/completions", {"prompt": huge}),
    ):
        r = http.post(path, json={"model": model_name, **body})
        check(r, 400, code="context_length_exceeded", says="characters")


def test_token_ids_are_checked_before_echo(http, model_name):
    for prompt in ([1, 2, 10**30], [-1], [[1, 2], [2**70]]):
        r = http.post("/v1/completions", json={"model": model_name, "prompt": prompt, "echo": True})
        check(r, 400, says="token ids")


def test_a_large_prompt_that_fits_is_served(http, model_name, server):
    """Prompts over the off-loop threshold are rendered and tokenized on a worker thread."""
    text = "ab " * 3000
    r = http.post(
        "/v1/completions",
        json={"model": model_name, "prompt": text[:9000], "max_tokens": 1},
    )
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:  # the tiny test model's context may be shorter than the text
        assert r.json()["error"]["code"] == "context_length_exceeded"


def test_openapi_documents_bodies_and_errors(http):
    doc = http.get("/openapi.json").json()
    post = doc["paths"]["/v1/responses"]["post"]
    assert "requestBody" in post
    assert {"400", "401", "403", "404", "413", "429"} <= set(post["responses"])
    assert "422" not in post["responses"]  # validation errors are 400 here
    assert "ErrorBody" in doc["components"]["schemas"]


# -- load shedding -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_engine(tmp_path_factory):
    """A small Llama with an 8k context: its streams run for many seconds, long enough to
    hold requests in flight while the test asks for more."""
    model = make_checkpoint(
        tmp_path_factory.mktemp("long"),
        "llama",
        max_position_embeddings=8192,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
    )
    config = EngineConfig(
        model=str(model),
        num_kv_blocks=4096,
        seed=0,
        calibrate=False,
        lanes={"ultrafast": {"speculative": False, "target_tokens_per_s": None}},
    )
    eng = AsyncEngine(LLMEngine(config))
    yield eng
    eng.shutdown()


@pytest.fixture
def small_queue_server(long_engine):
    settings = ServerSettings(store_path=":memory:", max_queued_per_lane=0, max_in_flight_per_key=6)
    with ServerThread(create_app(long_engine, settings)) as s:
        yield s


def _long(tier: str) -> dict:
    return {
        "input": "go",
        "stream": True,
        "store": False,
        "service_tier": tier,
        "max_output_tokens": 8000,
        "ignore_eos": True,
    }


@contextlib.contextmanager
def _streams(client: httpx.Client, bodies: list[dict]):
    """Open streams and read each one's first event, so they are running in the engine."""
    lines = []  # each stream's line iterator stays alive: closing one closes its stream
    with contextlib.ExitStack() as stack:
        for body in bodies:
            r = stack.enter_context(client.stream("POST", "/v1/responses", json=body))
            assert r.status_code == 200
            lines.append(r.iter_lines())
            next(lines[-1])
        yield


def _refused(client: httpx.Client, body: dict) -> httpx.Response:
    """POST a stream that must be refused; a stream that was admitted fails the test at once
    (closing it aborts the request)."""
    with client.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code != 200, "admitted"
        r.read()
        return r


def test_full_queues_answer_429_with_headers(small_queue_server, long_engine):
    with httpx.Client(base_url=small_queue_server.url, timeout=60) as c:
        with _streams(c, [_long("ultrafast")] * 4):
            r = _refused(c, _long("ultrafast"))
            check(r, 429, code="queue_full")
            assert int(r.headers["retry-after"]) >= 1
            assert "x-ratelimit-limit-requests" in r.headers
            with _streams(c, [_long("default")] * 2):
                r = _refused(c, _long("default"))
                check(r, 429, code="too_many_requests_in_flight")
                assert "retry-after" in r.headers and "x-ratelimit-remaining-requests" in r.headers
        for _ in range(100):  # the closed streams are aborted as the server notices
            r = c.post("/v1/responses", json={"input": "x", "max_output_tokens": 2})
            if r.status_code != 429:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text


def test_requests_the_engine_never_starts_get_429_queue_timeout(llama_dir):
    """With no queue wait allowed, every request times out in the queue: a plain request
    answers 429 with Retry-After, and nothing is left behind in the engine."""
    config = EngineConfig(
        model=str(llama_dir), num_kv_blocks=64, seed=0, calibrate=False, max_queue_seconds=0.0
    )
    engine = AsyncEngine(LLMEngine(config))
    app = create_app(engine, ServerSettings(store_path=":memory:"))
    bodies = {
        "/v1/responses": {"input": "x", "max_output_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        "/v1/completions": {"prompt": "x", "max_tokens": 2},
    }
    try:
        with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=60) as c:
            for path, body in bodies.items():
                r = c.post(path, json={"model": "llama", **body})
                check(r, 429, code="queue_timeout")
                assert r.headers["retry-after"] and "x-ratelimit-reset-requests" in r.headers
        assert not engine.engine.requests and engine.engine.kv.num_used_blocks == 0
    finally:
        engine.shutdown()


def test_max_output_tokens_holds_for_every_endpoint(engine):
    """A rule for every request (`admission.check_request`), written once: no endpoint may ask
    for more output tokens than `max_output_tokens`; each error names the endpoint's field,
    and a request that sets no limit gets the server's."""
    settings = ServerSettings(store_path=":memory:", max_output_tokens=20)
    asks = [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}]},
            "max_completion_tokens",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ("/v1/completions", {"prompt": "x"}, "max_tokens"),
        ("/v1/responses", {"input": "x"}, "max_output_tokens"),
    ]
    with ServerThread(create_app(engine, settings)) as srv:
        model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        for path, body, field in asks:
            r = httpx.post(srv.url + path, json={"model": model, **body, field: 21})
            err = check(r, 400, param=field)
            assert f"{field} (21) is more than this server's limit of 20" in err["message"], err
        for extra in ({"max_output_tokens": 20}, {}):
            body = {"input": "x", "ignore_eos": True, **extra}
            r = httpx.post(srv.url + "/v1/responses", json=body)
            assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 20, r.text

        async def over_websocket():
            url = srv.url.replace("http", "ws") + "/v1/responses"
            async with websockets.connect(url) as ws:
                create = {"type": "response.create", "input": "x", "max_output_tokens": 21}
                await ws.send(json.dumps(create))
                event = json.loads(await ws.recv())
                assert event["type"] == "error" and event["status"] == 400, event
                assert event["error"]["param"] == "max_output_tokens"

        asyncio.run(over_websocket())
