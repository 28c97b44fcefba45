"""The reasoning parsers by name, and the one a model's chat template calls for."""

from __future__ import annotations

from expresslane.server.harmony import HarmonyReasoningParser
from expresslane.server.reasoning import ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "none": ReasoningParser,
    "harmony": HarmonyReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        known = sorted(REASONING_PARSERS)
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}") from None


def detect_reasoning_parser(chat_template: str | None, tokenizer) -> ReasoningParser:
    """Harmony for a template that writes channels with a vocabulary that has the token."""
    has_token = tokenizer is not None and tokenizer.token_to_id("<|channel|>") is not None
    if has_token and "<|channel|>" in (chat_template or ""):
        return HarmonyReasoningParser()
    return ReasoningParser()
