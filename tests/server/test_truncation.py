"""`truncation` on the Responses API and POST /v1/responses/input_tokens, on the real server
with the official openai SDK: a conversation longer than the model's context is refused with
`disabled` (the default) and answered with `auto`, which drops the oldest input items whole;
the count equals the real create's `usage.input_tokens`. The cut rules are checked directly on
`truncation.fit` too."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import websockets

from expresslane.server.errors import APIError
from expresslane.server.truncation import cut_points, fit

from .conftest import STOP_AT_FIRST

SHORT = {"max_output_tokens": 4, "temperature": 0}
TURN = "alpha beta gamma delta epsilon"


def conversation(turns: int) -> list[dict]:
    """User and assistant turns, with a function call and its output after the first."""
    items: list[dict] = []
    for i in range(turns):
        items.append({"role": "user", "content": f"question {i}: {TURN}"})
        if i == 0:
            items.append({"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"})
            items.append({"type": "function_call_output", "call_id": "c1", "output": TURN})
        items.append({"role": "assistant", "content": f"answer {i}: {TURN}"})
    items.append({"role": "user", "content": "and the last question?"})
    return items


def count(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/responses/input_tokens", json=body)


@pytest.fixture(scope="module")
def mhttp(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def context(mhttp) -> int:
    return mhttp.get("/v1/models").json()["data"][0]["max_model_len"]


@pytest.fixture(scope="module")
def long_input(mhttp, model_name) -> list[dict]:
    """The shortest conversation() that does not fit the context."""
    for turns in range(2, 60):
        items = conversation(turns)
        r = count(mhttp, model=model_name, input=items)
        if r.status_code == 400:
            assert r.json()["error"]["code"] == "context_length_exceeded"
            return items
    raise AssertionError("no conversation was too long")


def test_disabled_refuses_and_auto_fits(client, model_name, long_input, context):
    for truncation in (None, "disabled"):
        extra = {} if truncation is None else {"truncation": truncation}
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=model_name, input=long_input, **SHORT, **extra)
        assert e.value.code == "context_length_exceeded"
    r = client.responses.create(
        model=model_name, input=long_input, truncation="auto", instructions="Be brief.", **SHORT
    )
    assert r.status in ("completed", "incomplete") and r.truncation == "auto"
    assert r.usage.input_tokens + SHORT["max_output_tokens"] <= context
    counted = client.responses.input_tokens.count(
        model=model_name,
        input=long_input,
        truncation="auto",
        instructions="Be brief.",
        extra_body={"max_output_tokens": SHORT["max_output_tokens"]},
    )
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == r.usage.input_tokens
    # all the input items stay listed, as sent
    assert len(client.responses.input_items.list(r.id, limit=100).data) == len(long_input)


def test_auto_keeps_the_most_that_fits_from_a_user_turn(http, model_name, long_input):
    """The count with auto equals the count of the longest suffix (starting at a user item)
    that fits untruncated; the function call pair goes or stays with the turn before it."""
    got = count(http, model=model_name, input=long_input, truncation="auto", instructions="Hi.")
    assert got.status_code == 200, got.text
    starts = [i for i, it in enumerate(long_input) if it.get("role") == "user"]
    for start in starts:
        plain = count(http, model=model_name, input=long_input[start:], instructions="Hi.")
        if plain.status_code == 200:
            break
    assert start > 0
    assert got.json() == {
        "object": "response.input_tokens",
        "input_tokens": plain.json()["input_tokens"],
    }


def test_input_tokens_match_usage(client, model_name):
    first = client.responses.create(model=model_name, input="Remember the word kumquat.", **SHORT)
    body = dict(
        model=model_name,
        input=[{"role": "user", "content": "What was the word?"}],
        instructions="Answer in one word.",
        previous_response_id=first.id,
    )
    counted = client.responses.input_tokens.count(**body)
    r = client.responses.create(**body, **SHORT)
    assert counted.input_tokens == r.usage.input_tokens > 0
    counted = client.responses.input_tokens.count(model=model_name, input="Hello there")
    r = client.responses.create(model=model_name, input="Hello there", extra_body=STOP_AT_FIRST)
    assert counted.input_tokens == r.usage.input_tokens


def test_auto_drops_an_item_too_long_to_render(client, http, model_name):
    huge = "lorem ipsum " * 5000  # more characters than any prompt this context holds
    items = [
        {"role": "user", "content": huge},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and now?"},
    ]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_name, input=items, **SHORT)
    assert e.value.code == "context_length_exceeded"
    r = client.responses.create(
        model=model_name, input=items, truncation="auto", extra_body=STOP_AT_FIRST
    )
    alone = count(http, model=model_name, input=items[2:]).json()["input_tokens"]
    assert r.usage.input_tokens == alone


def test_previous_response_context_is_truncated(client, model_name, long_input):
    half = len(long_input) // 2
    while long_input[half].get("role") != "user":
        half += 1
    first = client.responses.create(model=model_name, input=long_input[:half], **SHORT)
    rest = long_input[half:]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=model_name, input=rest, previous_response_id=first.id, **SHORT
        )
    assert e.value.code == "context_length_exceeded"
    body = dict(model=model_name, input=rest, previous_response_id=first.id, truncation="auto")
    r = client.responses.create(**body, extra_body=STOP_AT_FIRST)
    assert r.truncation == "auto" and r.previous_response_id == first.id
    assert client.responses.input_tokens.count(**body).input_tokens == r.usage.input_tokens


def test_input_tokens_errors(http, model_name, long_input):
    r = count(http, model="no-such-model", input="hi")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = count(http, model=model_name, input="hi", previous_response_id="resp_missing")
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "previous_response_not_found"
    r = count(http, model=model_name, input="hi", conversation="conv_1")
    assert r.status_code == 400 and r.json()["error"]["param"] == "conversation"
    r = count(http, model=model_name, input=[], truncation="auto")
    assert r.status_code == 400 and r.json()["error"]["code"] == "empty_input"
    r = count(http, model=model_name, input="hi", truncation="sometimes")
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncation"
    r = count(http, model=model_name, input=long_input, truncation="disabled")
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # not even the latest user item fits: auto cannot help
    r = count(
        http,
        model=model_name,
        input=[*long_input, {"role": "user", "content": TURN * 400}],
        truncation="auto",
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


async def test_websocket_truncation(server, model_name, long_input):
    url = server.url.replace("http://", "ws://") + "/v1/responses"

    async def turn(ws, **kw) -> dict:
        body = {"type": "response.create", "model": model_name, "input": long_input, **kw}
        await ws.send(json.dumps({**body, **SHORT}))
        while True:
            ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if ev["type"] in ("error", "response.completed", "response.incomplete"):
                return ev

    async with websockets.connect(url) as ws:
        err = await turn(ws)
        assert err["type"] == "error" and err["error"]["code"] == "context_length_exceeded"
        done = await turn(ws, truncation="auto")
        assert done["type"] != "error" and done["response"]["truncation"] == "auto"


# -- the cut rules, on template messages -----------------------------------------------------


def _msg(role: str, text: str = "x", **extra) -> dict:
    return {"role": role, "content": text, **extra}


def _call(call_id: str) -> dict:
    return _msg("assistant", "", tool_calls=[{"id": call_id, "type": "function", "function": {}}])


def test_cuts_fall_before_user_turns_and_never_inside_a_call():
    messages = [
        _msg("system"),  # 0
        _msg("user"),  # 1
        _call("a"),  # 2
        _msg("user"),  # 3: its output comes after this user turn: no cut here
        _msg("tool", tool_call_id="a"),  # 4
        _msg("user"),  # 5
        _msg("assistant"),  # 6
        _msg("user"),  # 7: the latest user turn
        _call("b"),  # 8
        _msg("tool", tool_call_id="b"),  # 9
    ]
    assert cut_points(messages) == [0, 1, 5, 7]
    assert cut_points([_msg("user")]) == [0]
    assert cut_points([_msg("assistant"), _call("c"), _msg("tool", tool_call_id="c")]) == [0, 1]


def test_fit_keeps_system_and_the_most_recent_turns():
    messages = [
        _msg("system", "S"),
        *[_msg(r, str(i)) for i in range(6) for r in ("user", "assistant")],
    ]
    tried = []

    def attempt(kept: list[dict]) -> list[str]:
        tried.append(len(kept))
        if len(kept) > 5:
            raise APIError(400, "too long", code="context_length_exceeded")
        return [m["content"] for m in kept]

    assert fit(messages, attempt, None) == ["S", "4", "4", "5", "5"]
    assert len(tried) <= 4  # bisection, not one render per dropped turn
    with pytest.raises(APIError) as e:
        fit(messages, attempt, 1)  # not even the last turn has few enough characters
    assert e.value.code == "context_length_exceeded"

    def other_error(kept):
        raise APIError(400, "bad", code="invalid_value")

    with pytest.raises(APIError) as e:
        fit(messages, other_error, None)
    assert e.value.code == "invalid_value"
