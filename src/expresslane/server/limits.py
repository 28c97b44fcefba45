"""Size limits checked before any rendering or tokenizing, and work moved off the event loop.

A request is measured with cheap counts first (items, tools, stop strings), then by the
characters of its text. The character bound is one no prompt that fits the context can pass:
each token covers at most `longest token` characters, so more than `max_model_len x longest`
characters cannot fit (the `max_prompt_chars` setting may lower it). Every limit answers 400
in the OpenAI shape, naming the field, before the request costs the engine anything.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from expresslane.server.errors import APIError, invalid

T = TypeVar("T")
OFF_LOOP_CHARS = 8192  # prompts longer than this are rendered and tokenized on a worker thread


def text_size(value: Any) -> int:
    """Characters of all strings in a JSON value (keys included), iteratively."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(k) for k in item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def check_count(count: int, limit: int, param: str, what: str) -> None:
    if count > limit:
        raise invalid(
            f"'{param}' holds {count} {what}; this server accepts at most {limit}.",
            param=param,
            code="too_many_items",
        )


def check_chars(chars: int, limit: int | None, param: str) -> None:
    if limit is not None and chars > limit:
        raise APIError(
            400,
            f"'{param}' holds {chars} characters of text, more than can fit this model's "
            f"context (at most {limit} characters here); shorten it.",
            param=param,
            code="context_length_exceeded",
        )


async def off_loop(fn: Callable[[], T], chars: int) -> T:
    """Run `fn` here for small requests, on a worker thread for large ones, so one large
    prompt never stalls the event loop that serves everyone else."""
    if chars <= OFF_LOOP_CHARS:
        return fn()
    return await asyncio.to_thread(fn)
