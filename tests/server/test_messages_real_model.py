"""The Messages API on a real instruct model (SmolLM2-135M-Instruct) through the official
`anthropic` SDK: a fact, streamed equal to plain, a forced tool_use valid against its schema in
every lane, a tool loop, count_tokens."""

from __future__ import annotations

import anthropic
import jsonschema
import pytest

MODEL = "smollm2"
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def smol(smollm2_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=smollm2_server.url, api_key="test", max_retries=0)


def test_a_fact_streamed_and_plain(smol):
    args = {
        "model": MODEL,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
    plain = smol.messages.create(**args, extra_body=GREEDY)
    assert "Paris" in plain.content[0].text
    with smol.messages.stream(**args, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in plain.content]
    assert streamed.usage.output_tokens == plain.usage.output_tokens
    counted = smol.messages.count_tokens(model=MODEL, messages=args["messages"])
    used = plain.usage
    assert counted.input_tokens == used.input_tokens + used.cache_read_input_tokens


@pytest.mark.parametrize("speed", ["fast", None, "flex"])
def test_a_forced_tool_use_then_its_result(smol, speed):
    extra = {"service_tier": "flex"} if speed == "flex" else {"speed": speed} if speed else {}
    m = smol.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={**GREEDY, **extra},
    )
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    assert m.usage.speed == ("fast" if speed == "fast" else "standard")
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "18C and sunny"}
    follow = smol.messages.create(
        model=MODEL,
        max_tokens=24,
        messages=[
            *ASK,
            {"role": "assistant", "content": m.content},
            {"role": "user", "content": [result]},
        ],
        tools=[WEATHER],
        extra_body=GREEDY,
    )
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens > m.usage.input_tokens
