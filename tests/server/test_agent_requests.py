"""The Responses API as coding agents send it (Codex CLI's first request, 0.169.0): namespace
tools, a custom (freeform) tool, hosted tools the server does not run, `client_metadata`,
`include`, `prompt_cache_key`, `store: false`, input items with ids. Through a real server and
the openai SDK; forced tool choices make any model call, so the demo model serves."""

from __future__ import annotations

import re

import openai
import pytest

from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from .conftest import ServerThread

MAX = 64
ECHO = {
    "type": "function",
    "name": "echo",
    "description": "Echo",
    "parameters": {
        "type": "object",
        "properties": {"word": {"type": "string", "maxLength": 3}},
        "required": ["word"],
        "additionalProperties": False,
    },
    "strict": False,
}
AGENTS = {"type": "namespace", "name": "agents", "description": "Sub-agents", "tools": [ECHO]}
PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Patch",
    "format": {"type": "grammar", "syntax": "regex", "definition": "[a-z]{1,3}"},
}
SEARCH = {"type": "web_search", "external_web_access": False}
CODEX = {
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "reasoning": {"summary": "auto"},
    "prompt_cache_key": "0195f0e7-session",
    "parallel_tool_calls": True,
}
CODEX_EXTRA = {"client_metadata": {"turn_id": "t1", "session_id": "s1"}}


def _input(text: str) -> list[dict]:
    return [
        {"type": "message", "id": "msg_dev", "role": "developer", "content": "Be brief."},
        {"type": "message", "id": "msg_1", "role": "user", "content": text},
    ]


def test_codex_first_request_is_accepted(client, model_name):
    r = client.responses.create(
        model=model_name,
        input=_input("list the files"),
        tools=[AGENTS, PATCH, SEARCH],
        tool_choice="auto",
        max_output_tokens=4,
        extra_body=CODEX_EXTRA,
        **CODEX,
    )
    assert r.status in ("completed", "incomplete")
    assert r.model_extra["tools_not_offered"] == ["web_search"]
    assert [t.type for t in r.tools] == ["namespace", "custom", "web_search"]
    assert r.prompt_cache_key == CODEX["prompt_cache_key"]


def test_hosted_tools_are_not_offered_to_the_model(client, model_name):
    def tokens(tools) -> int:
        r = client.responses.create(
            model=model_name, input="hi", tools=tools, max_output_tokens=1, store=False
        )
        return r.usage.input_tokens

    assert tokens([ECHO, SEARCH, {"type": "code_interpreter", "container": {"type": "auto"}}]) == (
        tokens([ECHO])
    )


def test_a_namespaced_call_names_its_namespace_and_replays(tool_client):
    client, model_name = tool_client, "llama"
    r = client.responses.create(
        model=model_name,
        input="x",
        tools=[AGENTS],
        tool_choice={"type": "function", "name": "echo", "namespace": "agents"},
        max_output_tokens=MAX,
        store=False,
    )
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert (call.name, call.namespace) == ("echo", "agents")
    replay = [
        {"role": "user", "content": "x"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "hi"},
    ]
    again = client.responses.create(
        model=model_name, input=replay, tools=[AGENTS], max_output_tokens=2, store=False
    )
    assert again.status in ("completed", "incomplete")
    assert again.usage.input_tokens > r.usage.input_tokens


def test_a_custom_tool_call_carries_its_input_text(tool_client):
    client, model_name = tool_client, "llama"
    r = client.responses.create(
        model=model_name,
        input="x",
        tools=[PATCH],
        tool_choice={"type": "custom", "name": "apply_patch"},
        max_output_tokens=MAX,
        store=False,
        temperature=0,
    )
    (call,) = [o for o in r.output if o.type == "custom_tool_call"]
    assert call.name == "apply_patch" and re.fullmatch("[a-z]{1,3}", call.input)
    stream = client.responses.create(
        model=model_name,
        input="x",
        tools=[PATCH],
        tool_choice={"type": "custom", "name": "apply_patch"},
        max_output_tokens=MAX,
        store=False,
        stream=True,
        temperature=0,
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert "response.custom_tool_call_input.delta" in kinds
    done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
    assert done.input == call.input  # greedy: the same call, streamed
    replay = [
        {"role": "user", "content": "x"},
        call.model_dump(exclude_none=True),
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "done"},
    ]
    again = client.responses.create(
        model=model_name, input=replay, tools=[PATCH], max_output_tokens=2, store=False
    )
    assert again.status in ("completed", "incomplete")


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tools": [{"type": "teleport"}]}, "tools[0]"),
        ({"include": ["everything"]}, "include[0]"),
        ({"client_metadata": {"k": 5}}, "client_metadata.k"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_what_openai_refuses_stays_a_400(client, model_name, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_name, input="hi", extra_body=extra)
    assert e.value.param is not None and e.value.param.startswith(param)


@pytest.fixture(scope="module")
def clamping(engine):
    settings = ServerSettings(store_path=":memory:", clamp_max_tokens=True)
    with ServerThread(create_app(engine, settings)) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)


def test_a_max_tokens_past_the_context_is_a_400_or_clamped(client, clamping, model_name, engine):
    ask = {"model": model_name, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**ask, max_tokens=32000)
    assert e.value.code == "context_length_exceeded"
    r = clamping.chat.completions.create(**ask, max_tokens=32000, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == engine.max_model_len
