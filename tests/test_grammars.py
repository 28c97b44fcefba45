"""The tool-call grammars of every format the server parses, against the demo tokenizer: the
markup the parser reads back is what the grammar allows, and nothing else is."""

from __future__ import annotations

import pytest

from expresslane.demo import demo_model_dir
from expresslane.engine.grammar import GrammarMatchers
from expresslane.server.grammars import MAX_INDENT, json_schema, tool_calls
from expresslane.server.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
)
from expresslane.tokenizer import Tokenizer

TOOLS = [
    {
        "name": "read",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
            "additionalProperties": False,
        },
    },
    {"name": "ls", "parameters": None},
]
CALL = {
    "hermes": '<tool_call>\n{"name": "read", "arguments": {"path": "a.py"}}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{"name": "read", "arguments": {"path": "a.py"}}]',
    "llama3_json": '{"name": "read", "parameters": {"path": "a.py"}}',
}
PARSERS = [HermesToolParser(), MistralToolParser(), Llama3JsonToolParser()]


@pytest.fixture(scope="module")
def grammars() -> tuple[GrammarMatchers, Tokenizer]:
    d = demo_model_dir()
    tok = Tokenizer.from_dir(d)
    return GrammarMatchers((d / "tokenizer.json").read_text(), 8192, [2], False), tok


def _accepts(grammars, grammar, text: str) -> bool:
    gm, tok = grammars
    ids = tok.encode(text, False)
    return gm.matcher(grammar).validate_tokens(ids) == len(ids)


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
def test_each_format_allows_its_own_calls_and_no_others(grammars, parser):
    gm, _ = grammars
    call = CALL[parser.name]
    text = call if parser.markup.anchored else "Let me look. " + call

    def grammar(choice, parallel=True):
        return tool_calls(parser.markup, TOOLS, choice, parallel, gm.literal)

    assert _accepts(grammars, grammar("auto"), text)
    assert _accepts(grammars, grammar("required"), call)
    assert _accepts(grammars, grammar({"name": "read"}), call)
    assert not _accepts(grammars, grammar({"name": "ls"}), call)
    undeclared = call.replace('"read"', '"list_dir"')
    assert not _accepts(grammars, grammar("required"), undeclared)
    if not parser.markup.anchored:  # (llama3_json's text may look like a call: parsed as text)
        assert not _accepts(grammars, grammar("auto"), undeclared)
    assert parser.parse(undeclared, {"read", "ls"}).tool_calls == []
    assert not _accepts(grammars, grammar("required"), call.replace('"a.py"', "7"))
    if not parser.markup.anchored:  # text may not spell the markup when calls are off
        assert not _accepts(grammars, grammar("none"), text)
        assert not _accepts(grammars, grammar("required"), text)  # no text before a forced call
    assert [c.name for c in parser.parse(call, {"read", "ls"}).tool_calls] == ["read"]


def test_parallel_calls_only_when_allowed(grammars):
    gm, _ = grammars
    p = HermesToolParser()
    two = CALL["hermes"] + "\n" + CALL["hermes"]
    assert _accepts(grammars, tool_calls(p.markup, TOOLS, "auto", True, gm.literal), two)
    assert not _accepts(grammars, tool_calls(p.markup, TOOLS, "auto", False, gm.literal), two)


def test_tool_schemas_with_refs_resolve(grammars):
    gm, _ = grammars
    params = {
        "type": "object",
        "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "properties": {"p": {"$ref": "#/$defs/P"}},
        "required": ["p"],
        "additionalProperties": False,
    }
    tools = [{"name": "f", "parameters": params}, {"name": "g", "parameters": params}]
    grammar = tool_calls(HermesToolParser.markup, tools, "required", True, gm.literal)
    call = '<tool_call>\n{"name": "g", "arguments": {"p": {"x": 3}}}\n</tool_call>'
    assert _accepts(grammars, grammar, call)
    assert not _accepts(grammars, grammar, call.replace("3", '"3"'))


def test_json_takes_the_models_own_spacing(grammars):
    """Compact or indented JSON, as the model writes it; not unbounded whitespace."""
    schema = {"type": "object", "properties": {"a": {"type": "array"}}, "required": ["a"]}
    grammar = json_schema(schema, "response_format")
    for text in ('{"a":[1,2]}', '{"a": [1, 2]}', '{\n  "a": [\n    1,\n    2\n  ]\n}'):
        assert _accepts(grammars, grammar, text), text
    assert not _accepts(grammars, grammar, '{\n\n  "a"')
    assert not _accepts(grammars, grammar, "{" + " " * (MAX_INDENT + 1))


def test_arguments_are_the_declared_ones_unless_others_are_allowed(grammars):
    gm, _ = grammars
    markup = HermesToolParser.markup
    listed = {"type": "object", "properties": {"path": {"type": "string"}}}
    extra = '<tool_call>\n{"name": "f", "arguments": {"path": "a", "mode": "r"}}\n</tool_call>'
    for params, ok in ((listed, False), ({**listed, "additionalProperties": True}, True)):
        grammar = tool_calls(
            markup, [{"name": "f", "parameters": params}], "required", False, gm.literal
        )
        assert _accepts(grammars, grammar, extra) == ok
    grammar = tool_calls(markup, [{"name": "f", "parameters": None}], "required", False, gm.literal)
    assert _accepts(grammars, grammar, extra)
