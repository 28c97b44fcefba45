"""`truncation: "auto"` on the Responses API: a conversation that does not fit the context, with
the output room the request needs, loses its oldest input items, whole, until it fits.

Always kept: every system message (the instructions, system and developer items) and the
conversation from the latest user message on. A cut falls only just before a user message, so
what is kept opens with a user turn (templates that insist on alternating roles still render
it), and never between a function call and its output. The latest cut that is needed is found
by bisection: a handful of renders however long the conversation.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import TypeVar

from expresslane.server.errors import APIError
from expresslane.server.limits import check_chars

T = TypeVar("T")
TOO_LONG = "context_length_exceeded"


def _inside_calls(messages: list[dict]) -> list[bool]:
    """blocked[c]: cutting before message c would part a function call from its output."""
    called_at = {
        call["id"]: i
        for i, m in enumerate(messages)
        for call in m.get("tool_calls") or ()
        if isinstance(call, dict) and "id" in call
    }
    depth = [0] * (len(messages) + 1)
    for j, m in enumerate(messages):
        i = called_at.get(m.get("tool_call_id")) if m["role"] == "tool" else None
        if i is not None and i < j:
            depth[i + 1] += 1
            depth[j + 1] -= 1
    return [d > 0 for d in accumulate(depth)]


def cut_points(messages: list[dict]) -> list[int]:
    """Where the conversation may be cut (all before goes but system messages), in order;
    0 (keep everything) first."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if users:
        last = users[-1]
    else:  # no user turn: keep the last turn with its tool outputs
        last = max((i for i, m in enumerate(messages) if m["role"] != "tool"), default=0)
    blocked = _inside_calls(messages)
    cuts = [i for i in (*users, last) if 0 < i <= last and not blocked[i]]
    return [0, *sorted(set(cuts))]


def kept(messages: list[dict], cut: int) -> list[dict]:
    return [m for m in messages[:cut] if m["role"] == "system"] + messages[cut:]


def _sizes(messages: list[dict], cuts: list[int]) -> list[int]:
    """Characters of message text kept by each cut (a lower bound on the rendered prompt)."""
    lengths = [len(m.get("content") or "") for m in messages]
    system = [n if m["role"] == "system" else 0 for n, m in zip(lengths, messages, strict=True)]
    before_system = [0, *accumulate(system)]
    after = [*accumulate(reversed(lengths))][::-1] + [0]
    return [before_system[c] + after[c] for c in cuts]


def fit(
    messages: list[dict],
    attempt: Callable[[list[dict]], T],
    max_chars: int | None,
    param: str = "input",
) -> T:
    """`attempt(kept)` for the most of the conversation that fits. `attempt` renders and
    tokenizes, raising an APIError with code context_length_exceeded when it does not fit; if
    even the latest turn does not, that error is raised. Cuts that keep more characters than
    any prompt that fits can hold (`max_chars`) are not rendered at all."""
    cuts = cut_points(messages)
    sizes = _sizes(messages, cuts)
    first = next((k for k, n in enumerate(sizes) if max_chars is None or n <= max_chars), None)
    if first is None:
        check_chars(sizes[-1], max_chars, param)

    def trial(k: int) -> tuple[bool, T | APIError]:
        try:
            return True, attempt(kept(messages, cuts[k]))
        except APIError as e:
            if e.code != TOO_LONG:
                raise
            return False, e

    ok, result = trial(first)
    if ok:
        return result
    found, best = False, None
    lo, hi = first + 1, len(cuts) - 1
    while lo <= hi:  # invariant: cuts below lo do not fit; the cut above hi does (if found)
        mid = (lo + hi) // 2
        ok, out = trial(mid)
        if ok:
            found, best, hi = True, out, mid - 1
        else:
            result, lo = out, mid + 1
    if not found:
        raise result
    return best
