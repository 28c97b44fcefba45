"""User text stays text: special-token strings a client writes are not the model's control tokens.

A chat template renders client strings (message content, names, tool arguments and schemas,
instructions) next to its own markup, into one string; encoded as is, a client's `<|im_end|>`
would become the control token and close its turn. So every client string is marked before
rendering (`SpecialTexts.mark`): MARK goes inside each occurrence of a special token's text, and
at an end of the string that could join the template's text into one. The rendered text's marks
are taken out and kept as positions (`ChatPrompt`); `Tokenizer.encode` then encodes a special
token whose text spans a mark as ordinary text. A prompt without marks encodes as before.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

MARK = "\ufdd0"  # a Unicode noncharacter: a client's own are dropped (and count as marks)


class ChatPrompt(str):
    """A rendered chat prompt: its text, and `marks`, the positions (between text[p - 1] and
    text[p]) where client strings held a special token's text or could join the template's."""

    marks: tuple[int, ...] = ()

    @classmethod
    def from_marked(cls, marked: str) -> ChatPrompt:
        parts = marked.split(MARK)
        prompt = cls("".join(parts))
        ends, pos = [], 0
        for part in parts[:-1]:
            pos += len(part)
            ends.append(pos)
        prompt.marks = tuple(ends)
        return prompt

    def __reduce__(self):
        return _rebuild, (str(self), self.marks)


def _rebuild(text: str, marks: tuple[int, ...]) -> ChatPrompt:
    prompt = ChatPrompt(text)
    prompt.marks = marks
    return prompt


def _trie(texts: Iterable[str]) -> dict:
    root: dict = {}
    for text in texts:
        node = root
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}
    return root


def _pattern(node: dict) -> str:
    """A regex matching the trie's strings, longest first (fast with thousands of them)."""
    alts = [re.escape(ch) + _pattern(child) for ch, child in node.items() if ch]
    body = alts[0] if len(alts) == 1 else f"(?:{'|'.join(alts)})" if alts else ""
    return f"(?:{body})?" if "" in node and body else body


def _walks(node: dict, chars: Iterable[str]) -> bool:
    """Whether `chars` is a path from `node` (a prefix of some string of the trie)."""
    for ch in chars:
        node = node.get(ch)
        if node is None:
            return False
    return True


class SpecialTexts:
    """The texts of a tokenizer's special tokens, found in client strings."""

    def __init__(self, texts: Iterable[str]):
        texts = sorted({t for t in texts if len(t) > 1})  # a 1-character one cannot hold a mark
        self.longest = max(map(len, texts), default=0)
        self._forward = _trie(texts)
        self._backward = _trie(t[::-1] for t in texts)
        self._find = re.compile(_pattern(self._forward)) if texts else None

    def mark(self, text: str) -> str:
        """`text` with MARK after the first character of each special token's text in it,
        before a start that ends one and after an end that begins one."""
        if self._find is None or not text:
            return text
        out = self._find.sub(lambda m: m[0][0] + MARK + m[0][1:], text)
        if self._joins_before(text):
            out = MARK + out
        if self._joins_after(text):
            out += MARK
        return out

    # Only an end with markup in it (not letters and digits alone) is marked, so that names a
    # template compares ("user", "function") stay as they are.
    def _joins_after(self, text: str) -> bool:
        tails = (text[i:] for i in range(max(0, len(text) - self.longest + 1), len(text)))
        return any(not t.isalnum() and _walks(self._forward, t) for t in tails)

    def _joins_before(self, text: str) -> bool:
        heads = (text[:k] for k in range(1, min(len(text), self.longest - 1) + 1))
        return any(not h.isalnum() and _walks(self._backward, reversed(h)) for h in heads)

    def mark_all(self, value: Any) -> Any:
        """A copy of `value` (JSON-like: dicts, lists, strings) with every string marked,
        dictionary keys too."""
        if isinstance(value, str):
            return self.mark(value)
        if isinstance(value, dict):
            return {self.mark_all(k): self.mark_all(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.mark_all(v) for v in value]
        return value
