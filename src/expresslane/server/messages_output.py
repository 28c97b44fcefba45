"""A Messages response as its outputs arrive: content blocks (`thinking`, then `text`, then
`tool_use`), built by the same steps whether streamed or not.

`MessageBuilder` turns each output into the stream's block events (`content_block_start`,
`content_block_delta`, `content_block_stop`) and keeps the blocks those events describe, so
that the message a client accumulates from the stream is the non-streamed one. Reasoning,
text and tool calls are split by the Chat path's `Choice` (the model's reasoning parser and
tool-call parser).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from expresslane.engine.output import RequestOutput
from expresslane.server.chat_choice import Choice, check_finished
from expresslane.server.reasoning import Split

Event = tuple[str, dict]  # (event name, its data)


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


class MessageBuilder:
    """One message's content blocks, and the events that build them."""

    def __init__(self, choice: Choice, sign: Callable[[str], str] | None):
        self.choice = choice
        self.sign = sign  # signs a thinking block; None: reasoning is not shown
        self.blocks: list[dict] = []
        self.open: dict | None = None  # the text or thinking block being written

    def add(self, out: RequestOutput) -> list[Event]:
        """The events one engine output adds."""
        check_finished(out)
        events = self._split(self.choice.add(out))
        if out.finished:
            events += self._split(self.choice.finish())
            events += self._close()
            for call in self.choice.calls:
                events += self._tool_use(call.name, call.arguments)
        return events

    def _split(self, split: Split) -> list[Event]:
        events = []
        if split.reasoning and self.sign is not None:
            events += self._write("thinking", split.reasoning)
        if split.content:
            events += self._write("text", split.content)
        return events

    def _write(self, kind: str, text: str) -> list[Event]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            block = {"type": kind, kind: ""}
            if kind == "thinking":
                block["signature"] = ""
            events.append(self._start(block))
            self.open = block
        self.open[kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        events.append(_delta(len(self.blocks) - 1, delta))
        return events

    def _start(self, block: dict) -> Event:
        self.blocks.append(block)
        return "content_block_start", {
            "type": "content_block_start",
            "index": len(self.blocks) - 1,
            "content_block": dict(block),
        }

    def _close(self) -> list[Event]:
        block, self.open = self.open, None
        if block is None:
            return []
        index = len(self.blocks) - 1
        events = []
        if block["type"] == "thinking" and self.sign is not None:
            block["signature"] = self.sign(block["thinking"])
            events.append(
                _delta(index, {"type": "signature_delta", "signature": block["signature"]})
            )
        return [*events, _stop(index)]

    def _tool_use(self, name: str, arguments: str) -> list[Event]:
        block = {"type": "tool_use", "id": tool_use_id(), "name": name, "input": {}}
        start = self._start(block)
        block["input"] = _object(arguments)
        index = len(self.blocks) - 1
        partial = json.dumps(block["input"])
        return [
            start,
            _delta(index, {"type": "input_json_delta", "partial_json": partial}),
            _stop(index),
        ]

    def stop(self, stops: list[str] | None) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) once the output finished."""
        final = self.choice.final
        if self.choice.calls:
            return "tool_use", None
        if final is not None and final.finish_reason == "length":
            return "max_tokens", None
        matched = final.stop_reason if final is not None else None
        if isinstance(matched, str) and matched in (stops or ()):
            return "stop_sequence", matched
        return "end_turn", None


def _object(arguments: str) -> dict:
    """A call's input: its arguments' JSON object (the tool grammar makes it one)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _delta(index: int, delta: dict) -> Event:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def _stop(index: int) -> Event:
    return "content_block_stop", {"type": "content_block_stop", "index": index}


def usage(out: RequestOutput | None, prompt_tokens: int, lane: str) -> dict:
    """Anthropic's usage: `input_tokens` are the prompt tokens the prefix cache did not hold
    (`cache_read_input_tokens` did), as Anthropic counts them; `speed` the lane that served."""
    cached = out.num_cached_tokens if out is not None else 0
    return {
        "input_tokens": (out.num_prompt_tokens if out is not None else prompt_tokens) - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": out.num_output_tokens if out is not None else 0,
        "service_tier": "priority" if lane == "ultrafast" else "standard",
        "speed": speed(lane),
    }


def speed(lane: str) -> str:
    return "fast" if lane == "ultrafast" else "standard"
