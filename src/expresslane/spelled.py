"""Streamed text that keeps special tokens, with the special tokens told apart from text that
only spells one.

A special token's text (`<|end|>`) can also be written by ordinary tokens (`<`, `|`, `end`,
`|>`), and a parser reading markers from text (harmony's, `server/harmony.py`) cannot tell the
two apart. So where special tokens are kept, ordinary tokens never write `<|` (or `<｜`) as is:
SPELLED (an invisible word joiner) goes between the two characters, and `unspell` takes it out
again once the markers are read. Text without special tokens is left as it is.
"""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

SPELLED = "\u2060"
OPENERS = ("<|", "<\uff5c")  # how the special tokens of harmony, ChatML, Llama 3, DeepSeek open


def openers(special_texts) -> tuple[str, ...]:
    """The OPENERS that begin some special token's text (the ones to spell apart)."""
    texts = list(special_texts)
    return tuple(o for o in OPENERS if any(t.startswith(o) for t in texts))


def unspell(text: str) -> str:
    for a, b in OPENERS:
        text = text.replace(a + SPELLED + b, a + b)
    return text


class SpelledStream:
    """An incremental detokenizer (`DecodeStream`) that spells special tokens apart when it
    keeps them."""

    __slots__ = ("decode", "openers", "special_ids", "last")

    def __init__(
        self,
        ids: list[int],
        skip_special_tokens: bool,
        special_ids: frozenset[int],
        openers: tuple[str, ...],
    ):
        self.decode = DecodeStream(ids=ids, skip_special_tokens=skip_special_tokens)
        self.openers = () if skip_special_tokens else openers
        self.special_ids = special_ids
        self.last = ""  # the last character ordinary tokens wrote, just before this token

    def step(self, tokenizer: HFTokenizer, token_id: int) -> str:
        text = self.decode.step(tokenizer, token_id) or ""
        if not self.openers or not text:
            return text
        if token_id in self.special_ids:
            self.last = ""
            return text
        for a, b in self.openers:
            text = text.replace(a + b, a + SPELLED + b)
            if self.last == a and text[0] == b:
                text = SPELLED + text
        self.last = text[-1]
        return text
