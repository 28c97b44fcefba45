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
from expresslane.server.tool_parsers import HermesToolParser
from expresslane.server.tool_prompt import ToolPromptTokenizer, tools_prompt
from expresslane.tokenizer import Tokenizer

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


# -- templates that cannot render tools (tool_prompt.py) -------------------------------------

PLAIN_CHATML = (  # SmolLM2's template: no tools, no tool calls
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def plain(llama_dir) -> ToolPromptTokenizer:
    hf = HFTokenizer.from_file(str(llama_dir / "tokenizer.json"))
    tok = Tokenizer(hf, {"chat_template": PLAIN_CHATML, "eos_token": "<|im_end|>"})
    return ToolPromptTokenizer(tok, HermesToolParser.markup)


def test_a_template_that_renders_tools_is_left_alone(tok):
    wrapped = ToolPromptTokenizer(tok, HermesToolParser.markup)
    assert wrapped.renders_tools
    user = [{"role": "user", "content": "Open a.py"}]
    assert render(wrapped, user, template_tools(TOOLS)) == render(tok, user, template_tools(TOOLS))


def test_tools_go_into_the_system_message(plain):
    assert not plain.renders_tools
    user = [{"role": "user", "content": "Open a.py"}]
    prompt = render(plain, user, template_tools(TOOLS))
    described = tools_prompt(template_tools(TOOLS), HermesToolParser.markup)
    assert prompt.startswith(f"<|im_start|>system\n{described}<|im_end|>\n<|im_start|>user\n")
    assert '"name": "read_file"' in described and "<tool_call>\n{" in described
    system = [{"role": "system", "content": "Be terse."}, *user]
    merged = render(plain, system, template_tools(TOOLS))
    assert merged.startswith(f"<|im_start|>system\nBe terse.\n\n{described}<|im_end|>\n")
    assert merged.count("<|im_start|>system") == 1
    assert render(plain, user, None) == "<|im_start|>user\nOpen a.py<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )


def test_a_call_turn_replays_as_the_model_wrote_it(plain):
    user = [{"role": "user", "content": "Open a.py"}]
    prompt = render(plain, user, template_tools(TOOLS))
    model_text = (
        'Sure.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
    )
    parsed = HermesToolParser().parse(model_text)
    history = user + output_messages(parsed.content, parsed.tool_calls)
    _, results = responses_input(
        [{"type": "function_call_output", "call_id": parsed.tool_calls[0].id, "output": "x=1"}],
        history,
    )
    replay = render(plain, history + results, template_tools(TOOLS))
    assert replay.startswith(prompt + model_text + "<|im_end|>\n")
    assert replay.endswith(
        "<|im_start|>user\n<tool_response>\nx=1\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
