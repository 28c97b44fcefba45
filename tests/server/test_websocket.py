"""Responses API WebSocket mode: a plain `websockets` client and the openai SDK's
`responses.connect()`."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import websockets

from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from .conftest import ServerThread

TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
LONG_INPUT = "Explain continuous batching, chunked prefill and preemption in detail. " * 3


def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/responses"


def create(model, **kw) -> str:
    body = {
        "type": "response.create",
        "model": model,
        "temperature": 0,
        "max_output_tokens": 4,
        **kw,
    }
    return json.dumps(body)


async def turn(ws) -> list[dict]:
    """Events up to a terminal event or an error."""
    events = []
    while True:
        ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
        events.append(ev)
        if ev["type"] in TERMINAL or ev["type"] == "error":
            return events


async def test_events_match_http(server, model_name, client):
    plain = client.responses.create(
        model=model_name, input="hello", temperature=0, max_output_tokens=4
    )
    async with websockets.connect(ws_url(server)) as ws:
        await ws.send(create(model_name, input="hello", stream=True, background=False))
        events = await turn(ws)
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == final["output"][0]["content"][0]["text"] == plain.output_text
    assert final["usage"]["output_tokens"] == plain.usage.output_tokens


async def test_queued_in_order_and_stream_id(server, model_name):
    async with websockets.connect(ws_url(server)) as ws:
        await ws.send(create(model_name, input="one", stream_id="a"))
        await ws.send(create(model_name, input="two", stream_id="b"))
        first, second = await turn(ws), await turn(ws)
    assert {e["stream_id"] for e in first} == {"a"} and {e["stream_id"] for e in second} == {"b"}
    assert first[-1]["type"] in TERMINAL and second[0]["type"] == "response.created"
    assert second[0]["sequence_number"] == 0
    assert first[0]["response"]["id"] != second[0]["response"]["id"]


async def test_store_false_chain_uses_connection_cache(server, model_name, http):
    async with websockets.connect(ws_url(server)) as ws:
        await ws.send(create(model_name, input=LONG_INPUT, store=False))
        a = (await turn(ws))[-1]["response"]
        await ws.send(create(model_name, input="more", store=False, previous_response_id=a["id"]))
        b = (await turn(ws))[-1]["response"]
        assert b["previous_response_id"] == a["id"]
        assert b["usage"]["input_tokens_details"]["cached_tokens"] >= 16
        # only the latest response is kept: a is gone now
        await ws.send(create(model_name, input="x", store=False, previous_response_id=a["id"]))
        err = (await turn(ws))[-1]
        assert err["type"] == "error" and err["status"] == 400
        assert err["error"]["code"] == "previous_response_not_found"
        assert err["error"]["param"] == "previous_response_id"
    assert http.get(f"/v1/responses/{a['id']}").status_code == 404


async def test_failed_continuation_evicts(server, model_name):
    async with websockets.connect(ws_url(server)) as ws:
        await ws.send(create(model_name, input="hi", store=False))
        a = (await turn(ws))[-1]["response"]
        bad = [{"type": "function_call_output", "call_id": "missing", "output": "x"}]
        await ws.send(create(model_name, input=bad, store=False, previous_response_id=a["id"]))
        err = (await turn(ws))[-1]
        assert err["type"] == "error" and err["error"]["param"] == "input[0].call_id"
        await ws.send(create(model_name, input="ok", store=False, previous_response_id=a["id"]))
        err = (await turn(ws))[-1]
        assert err["error"]["code"] == "previous_response_not_found"


async def test_bad_messages_get_error_events_and_socket_stays_open(server, model_name):
    async with websockets.connect(ws_url(server)) as ws:
        for msg, code in [
            ("{not json", "invalid_json"),
            (json.dumps({"type": "session.update"}), "unsupported_event_type"),
            (create(model_name, input="x", bogus=1), "unknown_parameter"),
            (create(model_name, input=""), "empty_input"),
            (create("no-such-model", input="x"), "model_not_found"),
        ]:
            await ws.send(msg)
            err = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert err["type"] == "error" and err["error"]["code"] == code, err
            assert err["status"] == (404 if code == "model_not_found" else 400)
        await ws.send(create(model_name, input="still here?"))
        assert (await turn(ws))[-1]["type"] in TERMINAL


async def test_warmup_then_continue(server, model_name):
    async with websockets.connect(ws_url(server)) as ws:
        await ws.send(create(model_name, input=LONG_INPUT, generate=False, store=False))
        warm = await turn(ws)
        r = warm[-1]["response"]
        assert warm[-1]["type"] == "response.completed" and r["output"] == []
        await ws.send(create(model_name, input="go", previous_response_id=r["id"], store=False))
        b = (await turn(ws))[-1]["response"]
        assert b["usage"]["input_tokens_details"]["cached_tokens"] >= 16


async def test_connection_lifetime_limit(tool_engine):
    settings = ServerSettings(
        store_path=":memory:", websocket_max_connection_seconds=0.5, served_model_name="llama"
    )
    with ServerThread(create_app(tool_engine, settings)) as srv:
        async with websockets.connect(ws_url(srv)) as ws:
            await ws.send(create("llama", input="hi"))
            assert (await turn(ws))[-1]["type"] == "response.completed"
            err = json.loads(await asyncio.wait_for(ws.recv(), 10))
            assert err["type"] == "error"
            assert err["error"]["code"] == "websocket_connection_limit_reached"
            with pytest.raises(websockets.ConnectionClosedOK):
                await asyncio.wait_for(ws.recv(), 10)
            assert ws.close_code == 1000


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inside the SDK's websocket code
def test_openai_sdk_connect(server, model_name):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0)
    with client.responses.connect() as conn:
        conn.response.create(
            model=model_name, input="hi", max_output_tokens=3, temperature=0, store=False
        )
        types = []
        for event in conn:
            types.append(event.type)
            if event.type in TERMINAL:
                first = event.response
                break
        conn.response.create(
            model=model_name,
            input="again",
            max_output_tokens=3,
            previous_response_id=first.id,
            store=False,
        )
        for event in conn:
            if event.type in TERMINAL:
                second = event.response
                break
    assert types[0] == "response.created"
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens


async def test_a_client_that_floods_the_inbox_is_closed_with_an_error(tool_engine):
    settings = ServerSettings(
        store_path=":memory:", websocket_max_queued_messages=2, served_model_name="llama"
    )
    with ServerThread(create_app(tool_engine, settings)) as srv:
        async with websockets.connect(ws_url(srv)) as ws:
            long = create("llama", input="hi", max_output_tokens=100, ignore_eos=True)
            for _ in range(6):  # one runs, two may wait: the fourth has no room
                await ws.send(long)
            events = []
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    events.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
            errors = [e for e in events if e["type"] == "error"]
            assert [e["error"]["code"] for e in errors] == ["websocket_inbox_full"]
            assert ws.close_code == 1008


async def test_cross_site_pages_cannot_open_websocket_mode_on_an_open_server(tool_engine):
    settings = ServerSettings(store_path=":memory:", served_model_name="llama")
    with ServerThread(create_app(tool_engine, settings)) as srv:
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(ws_url(srv), origin="http://attacker.example")
        assert refused.value.response.status_code == 403
        for origin in (srv.url, None):  # its own page, or not a browser
            async with websockets.connect(ws_url(srv), origin=origin) as ws:
                await ws.send(create("llama", input="hi"))
                assert (await turn(ws))[-1]["type"] == "response.completed"
    settings.websocket_allowed_origins = ["http://app.example"]
    with ServerThread(create_app(tool_engine, settings)) as srv:
        async with websockets.connect(ws_url(srv), origin="http://app.example") as ws:
            await ws.send(create("llama", input="hi"))
            assert (await turn(ws))[-1]["type"] == "response.completed"
        with pytest.raises(websockets.InvalidStatus):
            await websockets.connect(ws_url(srv), origin="http://attacker.example")
