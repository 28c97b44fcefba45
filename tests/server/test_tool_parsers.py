"""Tool-call parsers on fixed strings: formats, malformed fallbacks, streaming never leaks."""

from __future__ import annotations

import json

import pytest

from expresslane.server.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    detect_tool_parser,
    get_tool_parser,
)

HERMES_ONE = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris"}}\n</tool_call>'
)
HERMES_TWO = (
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "b.py"}}\n</tool_call>'
)


def args(call) -> dict:
    return json.loads(call.arguments)


def stream(parser, text: str, size: int) -> tuple[str, list]:
    s = parser.streamer()
    shown = "".join(s.feed(text[i : i + size]) for i in range(0, len(text), size))
    tail, calls = s.finish()
    return shown + tail, calls


def test_hermes_one_call_with_content():
    out = HermesToolParser().parse(HERMES_ONE)
    assert out.content == "Let me check."
    assert [c.name for c in out.tool_calls] == ["get_weather"]
    assert args(out.tool_calls[0]) == {"city": "Paris"}
    assert out.tool_calls[0].id.startswith("call_")


def test_hermes_parallel_calls_and_unique_ids():
    out = HermesToolParser().parse(HERMES_TWO)
    assert out.content == ""
    assert [args(c)["path"] for c in out.tool_calls] == ["a.py", "b.py"]
    assert len({c.id for c in out.tool_calls}) == 2


def test_hermes_arguments_as_string_and_unclosed_final_call():
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}'
    out = HermesToolParser().parse(text)
    assert out.content == "" and args(out.tool_calls[0]) == {"x": 1}


@pytest.mark.parametrize(
    "bad",
    [
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',  # bad JSON
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "f", "argum',  # truncated
        "<tool_call></tool_call>",
    ],
)
def test_hermes_malformed_falls_back_to_text(bad):
    text = "Sure. " + bad
    out = HermesToolParser().parse(text)
    assert out.tool_calls == []
    assert out.content == text


def test_plain_text_is_untouched():
    text = "def f(x):\n    return {'a': x}  # a < b\n"
    for parser in (HermesToolParser(), MistralToolParser(), Llama3JsonToolParser()):
        assert parser.parse(text).content == text
        assert parser.parse(text).tool_calls == []


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streaming_equals_whole_and_never_leaks_markup(size):
    parser = HermesToolParser()
    for text in (HERMES_ONE, HERMES_TWO, "a <tool_c but not a call", "x <tool_call>{bad"):
        whole = parser.parse(text)
        s = parser.streamer()
        shown = []
        for i in range(0, len(text), size):
            shown.append(s.feed(text[i : i + size]))
        tail, calls = s.finish()
        if whole.tool_calls:
            assert "<tool" not in "".join(shown)
        assert "".join(shown) + tail == whole.content
        assert [(c.name, c.arguments) for c in calls] == [
            (c.name, c.arguments) for c in whole.tool_calls
        ]


def test_streaming_holds_back_only_possible_marker_starts():
    s = HermesToolParser().streamer()
    assert s.feed("Hello <to") == "Hello"
    assert s.feed("day is fine") == " <today is fine"
    assert s.finish() == ("", [])


def test_llama3_json():
    p = Llama3JsonToolParser()
    out = p.parse('<|python_tag|>{"name": "search", "parameters": {"q": "x"}}')
    assert out.content == "" and out.tool_calls[0].name == "search"
    assert args(out.tool_calls[0]) == {"q": "x"}
    two = p.parse('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": 1}}')
    assert [c.name for c in two.tool_calls] == ["a", "b"]
    text = "{not json at all"
    assert p.parse(text).content == text
    assert stream(p, '  {"name": "a", "parameters": {}}', 2)[0] == ""
    assert stream(p, "Hello {world}", 2) == ("Hello {world}", [])


def test_mistral_both_formats():
    p = MistralToolParser()
    out = p.parse(
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]'
    )
    assert [c.name for c in out.tool_calls] == ["f", "g"] and out.content == ""
    out = p.parse('Ok [TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}')
    assert out.content == "Ok" and [c.name for c in out.tool_calls] == ["f", "g"]
    bad = "[TOOL_CALLS][{oops"
    assert p.parse(bad).content == bad


def test_calls_to_undeclared_tools_stay_text():
    text = 'Hi <tool_call>\n{"name": "list_dir", "arguments": {}}\n</tool_call>'
    p = HermesToolParser()
    assert [c.name for c in p.parse(text).tool_calls] == ["list_dir"]
    out = p.parse(text, declared={"read_file"})
    assert out.tool_calls == [] and out.content == text


def test_registry_and_detection():
    assert isinstance(get_tool_parser("qwen"), HermesToolParser)
    with pytest.raises(ValueError, match="unknown tool parser"):
        get_tool_parser("nope")
    assert detect_tool_parser(None).name == "hermes"
    assert detect_tool_parser("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert detect_tool_parser("<|python_tag|> ipython").name == "llama3_json"
    assert detect_tool_parser("<tool_call> ... ipython").name == "hermes"
