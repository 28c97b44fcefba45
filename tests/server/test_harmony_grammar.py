"""The harmony grammar (server/harmony_grammar.py) against a vocabulary with harmony's special
tokens: what `tool_choice` allows gpt-oss to write, and nothing else."""

from __future__ import annotations

import pytest

from expresslane.engine.grammar import GrammarMatchers
from expresslane.server.harmony_grammar import harmony_grammar

from .conftest import WEATHER
from .harmony_model import CALL, FINAL, THINK, make_tokenizer

OTHER = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
TOOLS = [WEATHER, OTHER]
THOUGHT = THINK.format("Hmm.\nLet me see.")
PARIS = CALL + '{"city": "Paris"}'
ANSWER = FINAL + "Sunny."
NAMED = {"name": "get_weather"}


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    out = tmp_path_factory.mktemp("harmony_tok")
    tok = make_tokenizer(out)
    ends = [tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]
    gm = GrammarMatchers((out / "tokenizer.json").read_text(), tok.vocab_size, ends, False)

    def accepts(choice, text: str, content: dict | None = None, tools=TOOLS) -> bool:
        grammar = harmony_grammar(tools, choice, gm.literal, content)
        ids = tok.encode(text, False)
        return gm.matcher(grammar).validate_tokens(ids) == len(ids)

    return accepts


@pytest.mark.parametrize(
    ("choice", "text", "allowed"),
    [
        ("auto", THOUGHT + ANSWER, True),
        ("auto", THOUGHT + PARIS, True),
        ("auto", PARIS, True),  # the analysis is the model's to skip
        ("auto", THOUGHT + CALL.replace("get_weather", "get_news") + "{}", False),
        ("auto", THOUGHT + CALL + '{"town": "Paris"}', False),
        ("auto", "Sunny.", False),  # no channel
        ("required", THOUGHT + ANSWER, False),
        ("required", THOUGHT + CALL.replace("get_weather", "get_time") + "{}", True),
        (NAMED, THOUGHT + CALL.replace("get_weather", "get_time") + "{}", False),
        (NAMED, THOUGHT + PARIS, True),
        ("none", THOUGHT + PARIS, False),
        ("none", THOUGHT + ANSWER, True),
    ],
)
def test_tool_choice_decides_what_gpt_oss_may_write(check, choice, text, allowed):
    assert check(choice, text) is allowed


def test_a_json_answer_is_the_final_channel_only(check):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    assert check("auto", THOUGHT + FINAL + '{"ok": true}', schema, tools=[])
    assert not check("auto", THOUGHT + FINAL + "Sure", schema, tools=[])
    assert harmony_grammar([], "auto", str, None) is None  # nothing to constrain
