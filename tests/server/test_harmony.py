"""gpt-oss's harmony format through a real server and the openai SDK: a tiny random gpt-oss
checkpoint overfit to answer in harmony (`harmony_model.py`), its reasoning out as Chat
`reasoning_content` and Responses `reasoning` items, its commentary-channel calls as tool
calls with arguments valid against the tool's schema, every streamed event valid against the
SDK's types, and the reasoning effort in the prompt."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from expresslane.config import EngineConfig
from expresslane.engine.engine import LLMEngine
from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from .conftest import CHAT_WEATHER, WEATHER, RecordingEngine, ServerThread
from .harmony_model import train_harmony_model

pytest.importorskip("transformers")
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def harmony_engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("harmony")
    train_harmony_model(out)
    eng = RecordingEngine(LLMEngine(EngineConfig(model=str(out), dtype="float32")))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def harmony_server(harmony_engine):
    settings = ServerSettings(store_path=":memory:", served_model_name="gpt-oss")
    with ServerThread(create_app(harmony_engine, settings)) as s:
        yield s


@pytest.fixture(scope="module")
def client(harmony_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=harmony_server.url + "/v1", api_key="test", max_retries=0)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_answers_with_reasoning_content(client):
    r = client.chat.completions.create(model="gpt-oss", messages=ask("hi"), max_tokens=40)
    message = r.choices[0].message
    assert message.reasoning_content == "Greet back."  # an extra field the SDK keeps
    assert message.content == "Hello there!"
    assert r.choices[0].finish_reason == "stop"
    assert 0 < r.usage.completion_tokens_details.reasoning_tokens < r.usage.completion_tokens


@pytest.mark.parametrize(
    "choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_chat_returns_the_commentary_call_as_tool_calls(client, choice):
    r = client.chat.completions.create(
        model="gpt-oss",
        messages=ask("Weather in Paris?"),
        tools=[CHAT_WEATHER],
        tool_choice=choice,
        max_tokens=60,
    )
    message = r.choices[0].message
    assert message.reasoning_content == "Look it up."
    assert message.content is None
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["parameters"])
    assert arguments == {"city": "Paris"}
    assert r.choices[0].finish_reason == "tool_calls"


def test_chat_streams_reasoning_then_the_call(harmony_server):
    body = {
        "model": "gpt-oss",
        "messages": ask("Weather in Paris?"),
        "tools": [CHAT_WEATHER],
        "max_tokens": 60,
        "stream": True,
    }
    url = harmony_server.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    chunks = [ChatCompletionChunk.model_validate(json.loads(line)) for line in lines]
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Look it up."
    assert not any(d.content for d in deltas)
    calls = [call for d in deltas for call in d.tool_calls or ()]
    assert [c.function.name for c in calls if c.function.name] == ["get_weather"]
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_responses_returns_reasoning_and_a_function_call(client):
    r = client.responses.create(
        model="gpt-oss", input="Weather in Paris?", tools=[WEATHER], max_output_tokens=60
    )
    reasoning, call = r.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [c.text for c in reasoning.content] == ["Look it up."]
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    follow = client.responses.create(
        model="gpt-oss",
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C"}],
        tools=[WEATHER],
        max_output_tokens=60,
    )
    assert [o.type for o in follow.output] == ["reasoning", "message"]
    assert follow.output[0].content[0].text == "It is 18C."
    assert follow.output_text == "Sunny, 18C."


def test_the_reasoning_before_a_call_is_replayed_to_the_model(client, harmony_engine):
    """gpt-oss reads the analysis that led to a call when it reads the call's result: from a
    replayed reasoning item (Responses) or `reasoning_content` (Chat)."""
    call = {"call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    thought = {"type": "reasoning", "id": "rs_1", "summary": []}
    thought["content"] = [{"type": "reasoning_text", "text": "Look it up."}]
    r = client.responses.create(
        model="gpt-oss",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            thought,
            {"type": "function_call", **call},
            {"type": "function_call_output", "call_id": "c1", "output": "18C"},
        ],
        tools=[WEATHER],
        max_output_tokens=60,
    )
    assert "analysis<|message|>Look it up.<|end|>" in harmony_engine.prompts[-1]
    assert r.output_text == "Sunny, 18C."
    fn = {"name": call["name"], "arguments": call["arguments"]}
    messages = [
        *ask("Weather in Paris?"),
        {
            "role": "assistant",
            "reasoning_content": "Look it up.",
            "tool_calls": [{"id": "c1", "type": "function", "function": fn}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    ]
    chat = client.chat.completions.create(
        model="gpt-oss", messages=messages, tools=[CHAT_WEATHER], max_tokens=60
    )
    assert chat.choices[0].message.content == "Sunny, 18C."
    assert chat.choices[0].message.reasoning_content == "It is 18C."


def stream_events(server, body: dict) -> list:
    """A streamed response's events, each validated against the SDK's event types."""
    body = {"model": "gpt-oss", "max_output_tokens": 60, "stream": True, **body}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    events = [EVENTS.validate_python(json.loads(line)) for line in lines]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


@pytest.mark.parametrize(
    ("body", "reasoning", "after"),
    [
        ({"input": "Weather in Paris?", "tools": [WEATHER]}, "Look it up.", "function_call"),
        ({"input": "hi"}, "Greet back.", "message"),
    ],
)
def test_streamed_responses_events_validate_against_the_sdk(harmony_server, body, reasoning, after):
    events = stream_events(harmony_server, body)
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == reasoning
    n = 4 + len(deltas)  # after created, in_progress, the reasoning item and its part
    assert kinds[2:4] + kinds[n : n + 4] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # the message or the function call
    ]
    final = Response.model_validate(events[-1].response.model_dump())
    assert final.status == "completed"
    assert [o.type for o in final.output] == ["reasoning", after]
    assert final.output[0].content[0].text == reasoning


def test_reasoning_effort_reaches_the_template(client, harmony_engine):
    client.chat.completions.create(
        model="gpt-oss", messages=ask("hi"), max_tokens=1, reasoning_effort="high"
    )
    assert "Reasoning: high" in harmony_engine.prompts[-1]
    client.responses.create(
        model="gpt-oss", input="hi", max_output_tokens=1, reasoning={"effort": "low"}
    )
    assert "Reasoning: low" in harmony_engine.prompts[-1]


def test_chat_streams_the_reasoning_before_the_answer(client):
    stream = client.chat.completions.create(
        model="gpt-oss", messages=ask("hi"), max_tokens=40, stream=True
    )
    order = []
    for chunk in stream:
        delta = chunk.choices[0].delta
        if getattr(delta, "reasoning_content", None):
            order.append(("reasoning", delta.reasoning_content))
        if delta.content:
            order.append(("content", delta.content))
    kinds = [k for k, _ in order]
    assert kinds == sorted(kinds, reverse=True)  # every reasoning delta first
    assert "".join(t for k, t in order if k == "reasoning") == "Greet back."
    assert "".join(t for k, t in order if k == "content") == "Hello there!"


def test_a_reasoning_effort_that_is_not_a_string_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="gpt-oss", input="hi", reasoning={"effort": 3})
    assert e.value.body["param"] == "reasoning.effort"


def test_sealed_reasoning_round_trips_without_a_store(client, harmony_engine, harmony_server):
    """Codex's way: `store: false` and `include: ["reasoning.encrypted_content"]`; the
    reasoning comes back sealed, and sent back alone (no text) it is rendered as the model's."""
    stateless = {"store": False, "include": ["reasoning.encrypted_content"]}
    r = client.responses.create(
        model="gpt-oss",
        input="Weather in Paris?",
        tools=[WEATHER],
        max_output_tokens=60,
        **stateless,
    )
    reasoning, call = r.output
    sealed = reasoning.encrypted_content
    assert sealed and "Look it up." not in sealed
    replay = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": sealed},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "18C"},
    ]
    follow = client.responses.create(
        model="gpt-oss", input=replay, tools=[WEATHER], max_output_tokens=60, **stateless
    )
    assert "analysis<|message|>Look it up.<|end|>" in harmony_engine.prompts[-1]
    assert follow.output_text == "Sunny, 18C."
    forged = dict(replay[1], encrypted_content=sealed[:-8] + "AAAAAAAA")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model="gpt-oss", input=[replay[0], forged, *replay[2:]], tools=[WEATHER]
        )
    assert (
        e.value.code == "invalid_encrypted_content"
        and e.value.param == "input[1].encrypted_content"
    )
