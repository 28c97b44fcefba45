"""Tools and structured outputs on a real instruct model whose chat template cannot render tools
and whose vocabulary has no `<tool_call>` token (SmolLM2-135M-Instruct), through the openai SDK:
forced calls in every tier, streamed and not, and parsed objects that hold the right fact."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel

MODEL = "smollm2"
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "description": "The current time in a timezone",
    "parameters": {
        "type": "object",
        "properties": {"timezone": {"type": "string"}},
        "required": ["timezone"],
    },
}
PARAMETERS = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}
ASK_WEATHER = "What is the weather in Paris?"
ASK_CITY = "Give me the capital of France as JSON with name, country and population."
CALL_TOKENS = 64


class City(BaseModel):
    name: str
    country: str
    population: int


@pytest.fixture(scope="module")
def smol(smollm2_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="test", max_retries=0)


def _check_call(name: str, arguments: str) -> None:
    assert name in PARAMETERS
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def test_a_plain_answer_holds_the_fact(smol):
    r = smol.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=16,
    )
    assert "Paris" in r.choices[0].message.content


def test_chat_completions_parse(smol):
    r = smol.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": ASK_CITY}],
        response_format=City,
        temperature=0,
        max_completion_tokens=64,
    )
    city = r.choices[0].message.parsed
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(city, City) and city.name == "Paris" and "france" in city.country.lower()


def test_responses_parse(smol):
    r = smol.responses.parse(
        model=MODEL, input=ASK_CITY, text_format=City, temperature=0, max_output_tokens=64
    )
    assert r.status == "completed"
    assert isinstance(r.output_parsed, City) and r.output_parsed.name == "Paris"


@pytest.mark.parametrize(
    "ask", ["What is the capital of France? Answer in JSON.", 'Reply with JSON only: {"ok": true}?']
)
def test_a_schema_the_answer_fits_leaves_it_as_it_was(smol, ask):
    """The model's own JSON, spacing included, whether or not a schema it fits constrains it."""

    def answer(**fmt) -> str:
        messages = [{"role": "user", "content": ask}]
        r = smol.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=40, **fmt
        )
        return r.choices[0].message.content

    free = answer()
    value = json.loads(free)
    schema = {
        "type": "object",
        "properties": {k: {} for k in value},
        "required": list(value),
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    assert answer(response_format=fmt) == free


CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_time"}}}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("tier", ["ultrafast", "default", "flex"])
@pytest.mark.parametrize("choice", CHOICES)
def test_chat_forced_calls(smol, choice, tier, stream):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": ASK_WEATHER}],
        tools=[{"type": "function", "function": t} for t in (WEATHER, TIME)],
        tool_choice=CHOICES[choice],
        temperature=0,
        max_tokens=CALL_TOKENS,
        service_tier=tier,
    )
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in smol.chat.completions.create(stream=True, **kw):
            delta = chunk.choices[0].delta
            for c in delta.tool_calls or []:
                call = calls.setdefault(c.index, {"name": "", "arguments": ""})
                call["name"] += c.function.name or ""
                call["arguments"] += c.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        found = [(c["name"], c["arguments"]) for c in calls.values()]
    else:
        r = smol.chat.completions.create(**kw)
        finish = r.choices[0].finish_reason
        found = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    assert finish == "tool_calls" and len(found) == 1
    if choice == "named":
        assert found[0][0] == "get_time"
    _check_call(*found[0])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("tier", ["ultrafast", "default", "flex"])
@pytest.mark.parametrize("choice", CHOICES)
def test_responses_forced_calls(smol, choice, tier, stream):
    named = {"type": "function", "name": "get_time"}
    kw = dict(
        model=MODEL,
        input=ASK_WEATHER,
        tools=[{"type": "function", **t} for t in (WEATHER, TIME)],
        tool_choice=named if choice == "named" else "required",
        temperature=0,
        max_output_tokens=CALL_TOKENS,
        service_tier=tier,
    )
    if stream:
        events = list(smol.responses.create(stream=True, **kw))
        assert events[-1].type == "response.completed"
        r = events[-1].response
    else:
        r = smol.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    if choice == "named":
        assert calls[0].name == "get_time"
    _check_call(calls[0].name, calls[0].arguments)
