"""The reasoning parsers (server/reasoning.py, server/harmony.py) and harmony's tool-call parser
on text cut into chunks anywhere: a streamed split always equals the whole text's."""

from __future__ import annotations

import json
import random

import pytest

from expresslane.server.harmony import HarmonyReasoningParser, call_markup
from expresslane.server.reasoning import ReasoningParser, Split
from expresslane.server.reasoning_parsers import get_reasoning_parser
from expresslane.server.tool_parsers import HarmonyToolParser, detect_tool_parser

THINK = "<|channel|>analysis<|message|>The user wants x < y; check <|end|> handling.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is <b>sunny</b>."
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}'
)
# the recipient in the role part of the header, as gpt-oss also writes it
CALL_IN_ROLE = (
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
    '<|message|>{"city": "Oslo"}'
)


def chunked(parser, text: str, seed: int) -> Split:
    rng = random.Random(seed)
    s, out, pos = parser.streamer(), Split(), 0
    while pos < len(text):
        step = rng.randint(1, 6)
        out += s.feed(text[pos : pos + step])
        pos += step
    return out + s.finish()


@pytest.mark.parametrize("seed", range(20))
def test_a_streamed_split_equals_the_whole_texts(seed):
    parser = HarmonyReasoningParser()
    for text in (THINK + FINAL, THINK + CALL, FINAL[len("<|start|>assistant") :], "plain text"):
        assert chunked(parser, text, seed) == parser.split(text)


def test_analysis_is_reasoning_and_final_is_content():
    split = HarmonyReasoningParser().split(THINK + FINAL)
    assert split.reasoning == "The user wants x < y; check "  # the marker ends the message
    split = HarmonyReasoningParser().split(
        "<|channel|>analysis<|message|>Think.<|end|>" + FINAL + "<|return|>"
    )
    assert split == Split("Think.", "It is <b>sunny</b>.")


def test_no_harmony_at_all_is_content():
    assert HarmonyReasoningParser().split("just words") == Split("", "just words")
    assert ReasoningParser().split(THINK) == Split("", THINK)
    assert get_reasoning_parser("harmony").needs_special_tokens
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("deepseek")


@pytest.mark.parametrize("seed", range(10))
def test_a_call_becomes_tool_markup_and_a_tool_call(seed):
    for text, city in ((THINK + CALL, "Paris"), (THINK + CALL_IN_ROLE, "Oslo")):
        split = chunked(HarmonyReasoningParser(), text, seed)
        assert split.content == call_markup("get_weather", json.dumps({"city": city}))
        parsed = HarmonyToolParser().parse(split.content, {"get_weather"})
        assert parsed.content == ""
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
            ("get_weather", {"city": city})
        ]


def test_a_harmony_call_to_an_undeclared_or_with_bad_json_stays_text():
    markup = call_markup("get_weather", '{"city": ')
    assert HarmonyToolParser().parse(markup).tool_calls == []
    good = call_markup("other", "{}")
    assert HarmonyToolParser().parse(good, {"get_weather"}).tool_calls == []


def test_a_harmony_template_picks_the_harmony_tool_parser():
    assert detect_tool_parser("{{ '<|start|>' }}<|channel|>final").name == "harmony"
