"""Tool calls end to end, on the real engine over a tiny Llama overfit (in conftest) to answer
these tests' prompts with fixed assistant text: Responses function_call items and events, Chat
tool_calls with dense indices through the SDK's stream helper, forced calls, malformed
fallback."""

from __future__ import annotations

import json

import openai
import pytest

from .conftest import CHAT_WEATHER, MALFORMED, WEATHER

MAX = 100  # room for the longest reply (the server defaults to 16 tokens)


def test_responses_function_calls(tool_client, tool_engine):
    r = tool_client.responses.create(
        model="llama", max_output_tokens=MAX, input="Weather?", tools=[WEATHER]
    )
    assert [o.type for o in r.output] == ["message", "function_call", "function_call"]
    assert r.output_text == "I'll check both."
    calls = r.output[1:]
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert all(c.name == "get_weather" and c.call_id.startswith("call_") for c in calls)
    assert r.status == "completed"

    with tool_client.responses.stream(
        model="llama", max_output_tokens=MAX, input="Weather?", tools=[WEATHER]
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert "<tool" not in deltas and deltas == "I'll check both."
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == [0, 1, 2]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments)["city"] for e in done] == ["Paris", "Oslo"]
    assert [o.type for o in final.output] == [o.type for o in r.output]

    one = tool_client.responses.create(
        model="llama",
        max_output_tokens=MAX,
        input="Weather?",
        tools=[WEATHER],
        parallel_tool_calls=False,
    )
    assert [o.type for o in one.output] == ["message", "function_call"]


def test_tool_call_round_trip_renders_history(tool_client, tool_engine):
    r = tool_client.responses.create(
        model="llama", max_output_tokens=MAX, input="Weather in Paris?", tools=[WEATHER]
    )
    call = r.output[0]
    assert call.type == "function_call"
    r2 = tool_client.responses.create(
        model="llama",
        max_output_tokens=MAX,
        previous_response_id=r.id,
        tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C"}],
    )
    assert r2.output_text == "It is sunny."
    prompt = tool_engine.prompts[-1]
    assert prompt.index("Weather in Paris?") < prompt.index("18C")
    items = tool_client.responses.input_items.list(r2.id)
    assert items.data[0].type == "function_call_output"


# MALFORMED capped at its tokens: its last token is "ci", but the grammar writes the key it
# forces ("city", the only parameter) in its canonical tokens, "c" "ity", so one letter less.
CAPPED = MALFORMED.removesuffix("i")


def test_malformed_call_falls_back_to_text(tool_client, tool_engine):
    # The model goes on writing after MALFORMED; capping it there ends the reply by length.
    cap = len(tool_engine.engine.tokenizer.encode(MALFORMED, False))
    r = tool_client.responses.create(
        model="llama", input="x", tools=[WEATHER], max_output_tokens=cap
    )
    assert [o.type for o in r.output] == ["message"]
    assert r.output_text == CAPPED
    assert r.status == "incomplete"
    c = tool_client.chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": "x"}],
        tools=[CHAT_WEATHER],
        max_tokens=cap,
    )
    assert c.choices[0].message.tool_calls is None
    assert c.choices[0].message.content == r.output_text
    assert c.choices[0].finish_reason == "length"


def test_forced_tool_choice_makes_the_model_call(tool_client, tool_engine):
    cap = len(tool_engine.engine.tokenizer.encode(MALFORMED, False))
    free = dict(model="llama", max_output_tokens=cap, input="x", tools=[WEATHER])
    r = tool_client.responses.create(**free)
    assert r.output_text == CAPPED  # free to choose, the model writes no (valid) call
    r = tool_client.responses.create(
        model="llama",
        max_output_tokens=MAX,
        input="x",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert tool_engine.prompts[-1].endswith("<|im_start|>assistant\n")  # nothing prefilled
    assert [o.type for o in r.output] == ["function_call"]
    assert json.loads(r.output[0].arguments) == {"city": "Rome"}
    r = tool_client.responses.create(
        model="llama", max_output_tokens=MAX, input="x", tools=[WEATHER], tool_choice="required"
    )
    assert r.output[0].name == "get_weather"
    with pytest.raises(openai.BadRequestError) as e:
        tool_client.responses.create(
            model="llama",
            input="x",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "nope"},
        )
    assert e.value.param == "tool_choice.name"


def test_chat_tool_calls_plain_and_streamed(tool_client, tool_engine):
    kwargs = dict(
        model="llama",
        max_tokens=MAX,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[CHAT_WEATHER],
    )
    c = tool_client.chat.completions.create(**kwargs)
    choice = c.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I'll check both."
    calls = choice.message.tool_calls
    assert [json.loads(t.function.arguments)["city"] for t in calls] == ["Paris", "Oslo"]

    with tool_client.chat.completions.stream(**kwargs) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        final = stream.get_final_completion()
    indices = [
        tc.index
        for ch in chunks
        for d in [ch.choices[0].delta]
        if ch.choices
        for tc in d.tool_calls or ()
    ]
    assert sorted(set(indices)) == [0, 1]
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == "I'll check both."
    fc = final.choices[0].message.tool_calls
    assert [json.loads(t.function.arguments)["city"] for t in fc] == ["Paris", "Oslo"]
    assert final.choices[0].finish_reason == "tool_calls"


def test_chat_tool_history_messages(tool_client, tool_engine):
    c = tool_client.chat.completions.create(
        model="llama",
        max_tokens=MAX,
        tools=[CHAT_WEATHER],
        messages=[
            {"role": "user", "content": "Weather there?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_9",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_9", "content": "18C"},
        ],
    )
    assert c.choices[0].message.content == "Done."
    assert "18C" in tool_engine.prompts[-1]


def test_replaying_output_items_as_input(tool_client, tool_engine):
    r = tool_client.responses.create(
        model="llama", max_output_tokens=MAX, input="Weather here?", tools=[WEATHER], store=False
    )
    call = r.output[1]
    history = [
        {"role": "user", "content": "Weather here?"},
        *[o.model_dump(exclude_none=True) for o in r.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "18C"},
    ]
    r2 = tool_client.responses.create(
        model="llama", max_output_tokens=MAX, input=history, tools=[WEATHER]
    )
    assert r2.output_text == "Sunny."
    assert tool_engine.prompts[-1].count("Checking.") == 1
