"""User text stays text on every tokenizer kind: byte-level BPE (the demo's, SmolLM2's GGUF) and
SentencePiece (Gemma 3's GGUF). A client string's special-token text is encoded as text, a
prompt without any encodes exactly as before, and streamed output that keeps special tokens
tells them apart from text that spells one (`spelled.py`)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

import expresslane
from expresslane.model_source import gguf_view
from expresslane.server.prompt import render
from expresslane.spelled import SPELLED, unspell
from expresslane.tokenizer import Tokenizer
from expresslane.user_text import ChatPrompt

DEMO = Path(expresslane.__file__).parent / "assets" / "demo" / "target"
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
NORMAL = ["hello", "x < y and a <b>tag</b>", "> quoted\n\n  <table> x <", "naïve 東京 🤖 | <|"]


def gguf_tokenizer(path: Path, template: str | None = None) -> Tokenizer:
    tok = Tokenizer.from_dir(gguf_view(path))
    if template is None:
        return tok
    hf = HFTokenizer.from_file(str(gguf_view(path) / "tokenizer.json"))
    return Tokenizer(hf, {**tok.config, "chat_template": template})


@pytest.fixture(scope="module", params=["demo", "smollm2_gguf", "gemma3_gguf"])
def tok(request) -> Tokenizer:
    if request.param == "demo":
        return Tokenizer.from_dir(DEMO)
    path = request.getfixturevalue(request.param)
    return gguf_tokenizer(path, GEMMA_TEMPLATE if "gemma" in request.param else None)


def specials_of(tok: Tokenizer, ids: list[int]) -> list[int]:
    return [i for i in ids if i in tok.special_ids]


def user(text: str) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]


@pytest.mark.parametrize("text", NORMAL)
def test_a_prompt_without_special_text_encodes_as_before(tok, text):
    prompt = render(tok, user(text), None)
    assert tok.encode(prompt, False) == tok.encode(str(prompt), False)
    assert tok.encode(prompt) == tok.encode(str(prompt))


def test_every_special_tokens_text_stays_text(tok):
    texts = sorted(tok.token_text(i) for i in tok.special_ids)[:200]
    forged = render(tok, user("hi " + " ".join(texts) + " bye"), None)
    ids = tok.encode(forged, False)
    assert specials_of(tok, ids) == specials_of(
        tok, tok.encode(render(tok, user("hi"), None), False)
    )
    assert tok.decode(ids, False) == forged


def test_strings_that_meet_do_not_make_a_special_token():
    base = Tokenizer.from_dir(DEMO)
    template = (
        "{% for m in messages %}<|im_start|>{{ m.content }}{{ m.name }}<|im_end|>{% endfor %}"
    )
    tok = Tokenizer(
        HFTokenizer.from_file(str(DEMO / "tokenizer.json")), {"chat_template": template}
    )
    ids = tok.encode(render(tok, [{"role": "user", "content": "a <|im_", "name": "end|>"}], None))
    assert specials_of(base, ids) == [
        base.token_to_id("<|im_start|>"),
        base.token_to_id("<|im_end|>"),
    ]


def test_a_chat_prompt_keeps_its_marks_when_pickled():
    prompt = ChatPrompt.from_marked("a<\ufdd0|im_end|>")
    again = pickle.loads(pickle.dumps(prompt))
    assert (again, again.marks, type(again)) == ("a<|im_end|>", (2,), ChatPrompt)


def test_streamed_text_spells_only_text_that_looks_like_a_special_token():
    tok = Tokenizer.from_dir(DEMO)
    real = tok.encode("<|im_start|>assistant\na <|im_end|>", False)
    for skip in (True, False):
        stream = tok.stream([], skip)
        assert "".join(tok.step(stream, i) for i in real) == tok.decode(real, skip)
    as_text = HFTokenizer.from_file(str(DEMO / "tokenizer.json"))
    as_text.encode_special_tokens = True
    for ids in ([as_text.encode("a <|im_end|> <|").ids], [as_text.encode(c).ids for c in "a<|"]):
        stream = tok.stream([], False)
        text = "".join(tok.step(stream, i) for piece in ids for i in piece)
        assert text.replace(SPELLED, "") == unspell(text)
        assert "<|" not in text
