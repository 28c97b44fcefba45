"""Responses API over HTTP with the real openai SDK: plain, streamed, stored, chained,
background, cancel, input items."""

from __future__ import annotations

import json
import time

import openai
import pytest

from .conftest import STOP_AT_FIRST

GREEDY = {"temperature": 0, "max_output_tokens": 8}
LONG_INPUT = "Tell me everything about the paged attention algorithm and prefix caching. " * 3


def test_create_plain(client, model_name):
    r = client.responses.create(model=model_name, input="Hello there", **GREEDY)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status in ("completed", "incomplete")
    assert r.model == model_name
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.content[0].type == "output_text"
    assert r.output_text == msg.content[0].text
    u = r.usage
    assert u.input_tokens > 0 and 1 <= u.output_tokens <= 8
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens >= 0
    assert r.service_tier == "default"
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
        assert u.output_tokens == 8


def test_stream_events_and_equality_with_non_streamed(client, model_name):
    kwargs = dict(
        model=model_name,
        input="Write a poem about caches",
        instructions="Be brief.",
        metadata={"k": "v"},
        **GREEDY,
    )
    plain = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    final = events[-1].response  # get_final_response() needs status completed
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[1] == "response.in_progress"
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types.index("response.output_item.added") < types.index("response.content_part.added")
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text
    assert {e.output_index for e in events if hasattr(e, "output_index")} == {0}
    assert final.output_text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert final.usage.input_tokens == plain.usage.input_tokens
    assert final.status == plain.status
    assert final.metadata == {"k": "v"} and final.instructions == "Be brief."
    assert [o.model_dump() for o in final.output][0]["content"][0]["text"] == plain.output_text


def test_stream_helper_final_response_equals_plain(client, model_name):
    kwargs = dict(
        model=model_name,
        input="Count to ten",
        temperature=0,
        max_output_tokens=8,
        extra_body=STOP_AT_FIRST,
    )
    plain = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.status == plain.status == "completed"
    assert final.output_text == plain.output_text
    for key in ("input_tokens", "output_tokens", "total_tokens"):
        assert getattr(final.usage, key) == getattr(plain.usage, key)
    # the second identical prompt is served from the prefix cache (full blocks only)
    assert final.usage.input_tokens_details.cached_tokens == 16 * (
        (plain.usage.input_tokens - 1) // 16
    )


async def test_async_client_and_stream(aclient, model_name):
    r = await aclient.responses.create(model=model_name, input="hi", **GREEDY)
    async with aclient.responses.stream(model=model_name, input="hi", **GREEDY) as stream:
        events = [e async for e in stream]
    assert events[-1].response.output_text == r.output_text


def test_store_retrieve_input_items_delete(client, model_name):
    r = client.responses.create(
        model=model_name,
        input=[
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        ],
        **GREEDY,
    )
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    items = client.responses.input_items.list(r.id, order="asc")
    assert [i.role for i in items.data] == ["developer", "user"]
    assert items.data[1].content[0].text == "Hello"
    desc = client.responses.input_items.list(r.id)
    assert [i.id for i in desc.data] == [i.id for i in reversed(items.data)]
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_store_false_is_not_kept(client, model_name):
    r = client.responses.create(model=model_name, input="hi", store=False, **GREEDY)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_name, input="more", previous_response_id=r.id)
    assert e.value.code == "previous_response_not_found"
    assert e.value.param == "previous_response_id"


def test_previous_response_chain_hits_prefix_cache(client, model_name):
    first = client.responses.create(model=model_name, input=LONG_INPUT, **GREEDY)
    second = client.responses.create(
        model=model_name, input="And then?", previous_response_id=first.id, **GREEDY
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 2
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= 16 * (first.usage.input_tokens // 16) - 16 > 0
    third = client.responses.create(
        model=model_name, input="Go on.", previous_response_id=second.id, **GREEDY
    )
    assert third.usage.input_tokens > second.usage.input_tokens
    assert third.usage.input_tokens_details.cached_tokens >= cached


def test_function_call_items_render(client, model_name):
    r = client.responses.create(
        model=model_name,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "18C sunny"},
        ],
        tools=[
            {
                "type": "function",
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            }
        ],
        **GREEDY,
    )
    assert r.status in ("completed", "incomplete")
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=model_name,
            input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}],
        )
    assert e.value.param == "input[0].call_id"


@pytest.mark.parametrize(
    "asked,served",
    [
        ("priority", "ultrafast"),
        ("fast", "ultrafast"),
        ("ultrafast", "ultrafast"),
        ("flex", "flex"),
        ("auto", "default"),
        ("standard", "default"),
    ],
)
def test_service_tier_echo(client, model_name, asked, served):
    r = client.responses.create(
        model=model_name, input="hi", service_tier=asked, max_output_tokens=2
    )
    assert r.service_tier == served


def test_background_poll_and_cancel(client, model_name):
    r = client.responses.create(model=model_name, input="hi", background=True, **GREEDY)
    assert r.status in ("queued", "in_progress") and r.background is True
    deadline = time.monotonic() + 30
    while r.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        r = client.responses.retrieve(r.id)
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens >= 1
    assert client.responses.cancel(r.id).status == r.status  # idempotent on finished ones

    long = client.responses.create(
        model=model_name,
        input="hi",
        background=True,
        max_output_tokens=400,
        extra_body={"ignore_eos": True},
    )
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(long.id).status == "cancelled"

    plain = client.responses.create(model=model_name, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(plain.id)


def test_background_stream_resume(client, model_name, http):
    with client.responses.stream(model=model_name, input="hi", background=True, **GREEDY) as stream:
        events = list(stream)
    rid = events[0].response.id
    r = http.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": 2})
    lines = [ln for ln in r.text.splitlines() if ln.startswith("data: {")]
    seqs = [json.loads(ln[6:])["sequence_number"] for ln in lines]
    assert seqs == list(range(3, len(events)))


def test_sse_ends_with_its_last_event_not_done(http, model_name):
    """OpenAI's Responses streams end with the terminal event: no `data: [DONE]` (Chat and
    Completions streams keep it)."""
    body = {"model": model_name, "input": "hi", "max_output_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as r:
        data = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert "[DONE]" not in data[-1]
    assert json.loads(data[-1][6:])["type"] in ("response.completed", "response.incomplete")
    chat = {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with http.stream("POST", "/v1/chat/completions", json={**chat, "max_tokens": 4}) as r:
        assert [line for line in r.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
