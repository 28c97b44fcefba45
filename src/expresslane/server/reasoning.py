"""Reasoning parsers: split a model's output text into its reasoning and its content (what
vLLM calls a reasoning parser). One is chosen per model (`reasoning_parsers.py`): harmony for
gpt-oss (`harmony.py`), none for the others, whose whole text is content.

A parser's `streamer()` is fed text deltas and returns the `Split` that is safe to pass on
now; `finish()` returns the rest. The content goes on to the tool-call parser, so a call the
model writes in its own channel reaches it as that parser's markup. `split(text)` runs the
same streamer over the whole text, so a streamed result always equals the non-streamed one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from expresslane.server.errors import invalid
from expresslane.server.schemas import REASONING_EFFORTS


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""

    def __add__(self, other: Split) -> Split:
        return Split(self.reasoning + other.reasoning, self.content + other.content)


class ReasoningStreamer(Protocol):
    def feed(self, delta: str) -> Split: ...

    def finish(self) -> Split: ...


class ReasoningParser:
    """Base class: no reasoning, the whole text is content."""

    name = "none"
    # True when the format's markers are special tokens that detokenizing must keep.
    needs_special_tokens = False

    def streamer(self) -> ReasoningStreamer:
        return _ContentOnly()

    def split(self, text: str) -> Split:
        s = self.streamer()
        return s.feed(text) + s.finish()


class _ContentOnly:
    def feed(self, delta: str) -> Split:
        return Split(content=delta)

    def finish(self) -> Split:
        return Split()


def reasoning_tokens(tokenizer, text: str) -> int:
    """How many output tokens the reasoning took (its text re-encoded), for the usage."""
    if not text or tokenizer is None:
        return 0
    return len(tokenizer.encode(text, False))


def requested_effort(reasoning: dict | None) -> str | None:
    """A Responses request's `reasoning.effort`, for the chat template: one of OpenAI's values,
    never free text (gpt-oss's template writes it into the system message)."""
    effort = (reasoning or {}).get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise invalid(
            f"'reasoning.effort' must be one of {', '.join(REASONING_EFFORTS)}; got {effort!r}.",
            param="reasoning.effort",
            code="invalid_value",
        )
    return effort
