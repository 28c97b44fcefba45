"""Anthropic's Messages API through a real server, with the official `anthropic` SDK as the
client: text, streaming (the SDK's accumulated stream equals the plain message), stop
sequences, count_tokens, errors as the SDK's exception types, tool_use on the model trained
to call tools (forced in every tier, and a loop with tool_result), fast mode with real keys
(`usage.speed`, Anthropic's rate-limit headers, and a full fast lane answered at once by the
key's policy), and Claude Code's CLI where it can run."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from expresslane.server.messages_thinking import sign

GREEDY = {"temperature": 0}  # the SDK no longer types temperature: sent as an extra field
HI = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="test", max_retries=0)


def create(client: anthropic.Anthropic, **kwargs):
    args = {"model": "llama", "max_tokens": 12, "messages": HI, "extra_body": GREEDY}
    return client.messages.create(**{**args, **kwargs})


def test_a_text_message(claude, model_name):
    m = create(claude, model=model_name, system="You write Python.")
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == model_name
    assert [b.type for b in m.content] == ["text"] * len(m.content) and len(m.content) <= 1
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    u = m.usage
    assert 0 < u.output_tokens <= 12 and u.input_tokens > 0
    assert u.cache_read_input_tokens >= 0 and u.cache_creation_input_tokens == 0
    assert u.speed == "standard"  # open local mode's default tier is the default lane
    if m.stop_reason == "max_tokens":
        assert u.output_tokens == 12


def test_the_streamed_message_equals_the_plain_one(claude, model_name):
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    args = {"model": model_name, "max_tokens": 16, "messages": HI, "system": system}
    plain = claude.messages.create(**args, extra_body=GREEDY)
    with claude.messages.stream(**args, extra_body=GREEDY) as stream:
        texts = list(stream.text_stream)
        streamed = stream.get_final_message()
    assert _blocks(streamed) == _blocks(plain) and "".join(texts) == _text(plain)
    assert (streamed.stop_reason, streamed.stop_sequence) == (plain.stop_reason, None)
    assert streamed.usage.output_tokens == plain.usage.output_tokens
    assert _prompt_tokens(streamed.usage) == _prompt_tokens(plain.usage)
    assert streamed.usage.speed == "standard"


def test_stream_events_come_in_anthropics_order(server, model_name):
    body = {"model": model_name, "max_tokens": 8, "messages": HI, "stream": True, **GREEDY}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[::2]]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [d["type"] for d in datas] == names  # every event line names its data's type
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    blocks = names[2:-2]
    if blocks:
        assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
        assert set(blocks[1:-1]) == {"content_block_delta"}
    assert datas[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert datas[0]["message"]["usage"]["output_tokens"] == 0
    assert 0 < datas[-2]["usage"]["output_tokens"] <= 8


def test_a_stop_sequence_ends_the_message_where_it_first_appears(claude, model_name):
    full = _text(create(claude, model=model_name, max_tokens=24))
    stop = next(
        full[i : i + 2] for i in range(4, len(full) - 2) if full[i : i + 2].strip() == full[i : i + 2]
    )
    m = create(claude, model=model_name, max_tokens=24, stop_sequences=["\x00never", stop])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert _text(m) == full[: full.index(stop)]


def test_count_tokens_is_the_prompt_of_the_real_request(claude, model_name):
    args = {
        "model": model_name,
        "system": "Count me.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x = 1"}]}],
    }
    counted = claude.messages.count_tokens(**args)
    m = claude.messages.create(**args, max_tokens=2, extra_body=GREEDY)
    assert counted.input_tokens == _prompt_tokens(m.usage)


def _text(m) -> str:
    return "".join(b.text for b in m.content if b.type == "text")


def _blocks(m) -> list[dict]:
    """A message's content blocks as plain data (the stream's are `Parsed...Block`s)."""
    return [b.model_dump(exclude={"parsed_output"}) for b in m.content]


def _prompt_tokens(usage) -> int:
    """Anthropic counts cached prompt tokens apart from `input_tokens`."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
