"""Prompt rendering: input items -> template messages, and a replayed tool-call turn renders
exactly the text the model wrote (so the KV prefix cache serves the whole history)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer

from expresslane.demo import TARGET_DIR as DEMO_MODEL_DIR
from expresslane.server.errors import APIError
from expresslane.server.prompt import (
    chat_messages,
    output_messages,
    render,
    responses_input,
    template_tools,
)
from expresslane.tokenizer import Tokenizer
from expresslane.tool_parsers import HermesToolParser

TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
]


def hermes_template() -> str:
    """The demo model's chat template (from its checkpoint, or from its training script)."""
    cfg = DEMO_MODEL_DIR / "tokenizer_config.json"
    if cfg.is_file():
        return json.loads(cfg.read_text())["chat_template"]
    train = pytest.importorskip(
        "scripts.train_demo_model", reason="no Hermes chat template available"
    )
    return train.CHAT_TEMPLATE


@pytest.fixture(scope="module")
def tok(llama_dir) -> Tokenizer:
    hf = HFTokenizer.from_file(str(llama_dir / "tokenizer.json"))
    return Tokenizer(hf, {"chat_template": hermes_template(), "eos_token": "<|im_end|>"})


def test_tool_call_turn_replays_verbatim(tok):
    user = [{"role": "user", "content": "Open a.py and b.py"}]
    prompt = render(tok, user, template_tools(TOOLS))
    assert "<tools>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    model_text = (
        'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": '
        '"a.py"}}\n</tool_call>\n<tool_call>\n{"name": "read_file", "arguments": '
        '{"path": "b.py"}}\n</tool_call>'
    )
    parsed = HermesToolParser().parse(model_text)
    history = user + output_messages(parsed.content, parsed.tool_calls)
    ids = [c.id for c in parsed.tool_calls]
    _, results = responses_input(
        [
            {"type": "function_call_output", "call_id": ids[0], "output": "print(1)"},
            {"type": "function_call_output", "call_id": ids[1], "output": "print(2)"},
        ],
        history,
    )
    assert [m["name"] for m in results] == ["read_file", "read_file"]
    replay = render(tok, history + results, template_tools(TOOLS))
    assert replay.startswith(prompt + model_text + "<|im_end|>\n")
    assert replay.count("<tool_response>") == 2


def test_text_turn_replays_verbatim(tok):
    user = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    prompt = render(tok, user, None)
    replay = render(
        tok, user + output_messages("Hello!", []) + [{"role": "user", "content": "Bye"}], None
    )
    assert replay.startswith(prompt + "Hello!<|im_end|>\n")


def test_input_items_to_messages():
    items, msgs = responses_input(
        [
            {"role": "developer", "content": "rules"},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "a"},
                    {"type": "input_text", "text": "b"},
                ],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "calling", "annotations": []}],
            },
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_text", "text": "done"}],
            },
        ],
        [],
    )
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert msgs[1]["content"] == "a\nb"
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "done"}
    assert [i["type"] for i in items] == [
        "message",
        "message",
        "message",
        "function_call",
        "function_call_output",
    ]
    assert all(i["id"] for i in items)


@pytest.mark.parametrize(
    "bad,param",
    [
        ([{"role": "user"}], "input[0].content"),
        ([{"role": "bot", "content": "x"}], "input[0].role"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
        ([{"type": "item_reference", "id": "msg_1"}], "input[0].type"),
        (["just a string"], "input[0]"),
    ],
)
def test_bad_items_name_the_field(bad, param):
    with pytest.raises(APIError) as e:
        responses_input(bad, [])
    assert e.value.status == 400 and e.value.param == param


def test_chat_messages():
    msgs = chat_messages(
        [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "ok"},
        ]
    )
    assert msgs[0]["content"] == "hi" and msgs[2]["name"] == "f"
    with pytest.raises(APIError) as e:
        chat_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert e.value.param == "messages[0].content[0].type"
