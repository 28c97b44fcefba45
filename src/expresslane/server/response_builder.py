"""The Responses API response object, and the assembler that turns a generation's text
deltas into output items and the documented stream events, in order:

created, in_progress, [reasoning: output_item.added, content_part.added, reasoning_text.delta...,
reasoning_text.done, content_part.done, output_item.done], [output_item.added,
content_part.added, output_text.delta..., output_text.done, content_part.done,
output_item.done], [function_call: output_item.added, function_call_arguments.delta, .done,
output_item.done]..., then exactly one of completed / incomplete / failed. Output and content
indices are dense from 0. A non-streamed response runs the same assembler and ignores the
events, so it always equals the streamed final response.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from expresslane.engine.output import RequestOutput
from expresslane.server.logprobs import chat_logprobs
from expresslane.server.prompt import new_id, output_messages
from expresslane.server.reasoning import (
    ReasoningParser,
    ReasoningStreamer,
    Split,
    reasoning_tokens,
)
from expresslane.server.reasoning_item import ReasoningItem
from expresslane.server.schemas import ResponseCreateRequest
from expresslane.server.tool_parsers import ToolCall, ToolCallStreamer


def base_response(
    rid: str,
    req: ResponseCreateRequest,
    *,
    model: str,
    tier: str,
    tools: list[dict],
    tool_choice,
    store: bool,
) -> dict:
    reasoning = req.reasoning or {}
    verbosity = req.text.verbosity if req.text and req.text.verbosity else "medium"
    fmt = req.text.format if req.text and req.text.format else None
    text_format = fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "queued" if req.background else "in_progress",
        "background": bool(req.background),
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "model": model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "service_tier": tier,
        "store": store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": text_format, "verbosity": verbosity},
        "tool_choice": tool_choice,
        "tools": tools,
        "top_logprobs": req.top_logprobs or 0,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
        "prompt_cache_key": req.prompt_cache_key,
        "safety_identifier": req.safety_identifier,
    }


def usage(out: RequestOutput | None) -> dict:
    n_in = out.num_prompt_tokens if out else 0
    n_out = out.num_output_tokens if out else 0
    return {
        "input_tokens": n_in,
        "input_tokens_details": {
            "cached_tokens": out.num_cached_tokens if out else 0,
            "cache_write_tokens": 0,
        },
        "output_tokens": n_out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": n_in + n_out,
    }


def plain_call_item(call: ToolCall, status: str) -> dict:
    """A call as a `function_call` output item (see `response_tools.Offered.call_item`)."""
    return {
        "id": new_id("fc"),
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
    }


class ResponseAssembler:
    def __init__(
        self,
        response: dict,
        emit: Callable[[dict], None],
        tokenizer,
        streamer: ToolCallStreamer | None = None,
        with_logprobs: bool = False,
        max_calls: int | None = None,
        splitter: ReasoningStreamer | None = None,
        call_item: Callable[[ToolCall, str], dict] | None = None,
        seal: Callable[[str], str] | None = None,
    ):
        self.r = response
        self.splitter = splitter or ReasoningParser().streamer()
        self.reasoning: ReasoningItem | None = None
        self.reasoning_text = ""  # all of the output's reasoning
        self.emit = emit
        self.tokenizer = tokenizer
        self.streamer = streamer
        self.with_logprobs = with_logprobs
        self.max_calls = max_calls
        self.msg: dict | None = None
        self.msg_index = -1
        self.pending_logprobs: list[dict] = []
        self.text = ""  # the visible output text
        self.calls: list[ToolCall] = []
        self.call_item = call_item or plain_call_item
        self.seal = seal  # reasoning items come back sealed too (`include` asked for it)

    # -- events -----------------------------------------------------------------------------

    def start(self) -> None:
        self.emit({"type": "response.created", "response": self.r})
        self.r["status"] = "in_progress"
        self.emit({"type": "response.in_progress", "response": self.r})

    def _open_message(self) -> None:
        self.msg = {
            "id": new_id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self.msg_index = len(self.r["output"])
        self.r["output"].append(self.msg)
        self.emit(
            {"type": "response.output_item.added", "output_index": self.msg_index, "item": self.msg}
        )
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.msg["content"].append(part)
        self.emit(
            {
                "type": "response.content_part.added",
                "item_id": self.msg["id"],
                "output_index": self.msg_index,
                "content_index": 0,
                "part": part,
            }
        )

    def _text(self, text: str) -> None:
        if not text:
            return
        if self.msg is None:
            self._open_message()
        part = self.msg["content"][0]
        part["text"] += text
        lps, self.pending_logprobs = self.pending_logprobs, []
        part["logprobs"].extend(lps)
        self.text += text
        self.emit(
            {
                "type": "response.output_text.delta",
                "item_id": self.msg["id"],
                "output_index": self.msg_index,
                "content_index": 0,
                "delta": text,
                "logprobs": lps,
            }
        )

    def add(self, out: RequestOutput) -> None:
        if self.with_logprobs and out.new_logprobs:
            self.pending_logprobs += chat_logprobs(
                self.tokenizer, out.new_token_ids, out.new_logprobs
            )
        self._split(self.splitter.feed(out.new_text))

    def _split(self, split: Split) -> None:
        if split.reasoning:
            if self.reasoning is None:
                self.reasoning = ReasoningItem(self.r["output"], self.emit, self.seal)
            self.reasoning.add(split.reasoning)
            self.reasoning_text += split.reasoning
        content = self.streamer.feed(split.content) if self.streamer else split.content
        if content:
            self._close_reasoning()
        self._text(content)

    def turn(self, calls: list[ToolCall]) -> list[dict]:
        """The assistant turn so far as template messages, with `calls`."""
        return output_messages(self.text, calls, self.reasoning_text)

    def _close_reasoning(self, status: str = "completed") -> None:
        if self.reasoning is not None:
            self.reasoning.close(status)
            self.reasoning = None

    def finish(self, final: RequestOutput | None, error: str | None = None) -> None:
        """Close open items and emit the terminal event (failed when `error` is set)."""
        self._split(self.splitter.finish())
        incomplete = error is None and final is not None and final.finish_reason == "length"
        self._close_reasoning("incomplete" if incomplete else "completed")
        if self.streamer is not None:
            tail, calls = self.streamer.finish()
            self._text(tail)
            if calls and not self.r["parallel_tool_calls"]:
                calls = calls[:1]
            self.calls = calls[: self.max_calls] if self.max_calls else calls
        if self.pending_logprobs and self.msg is not None:
            self.msg["content"][0]["logprobs"].extend(self.pending_logprobs)
        incomplete = error is None and final is not None and final.finish_reason == "length"
        item_status = "incomplete" if incomplete else "completed"
        if self.msg is None and not self.calls:
            self._open_message()
        if self.msg is not None:
            part, mid, idx = self.msg["content"][0], self.msg["id"], self.msg_index
            self.emit(
                {
                    "type": "response.output_text.done",
                    "item_id": mid,
                    "output_index": idx,
                    "content_index": 0,
                    "text": part["text"],
                    "logprobs": part["logprobs"],
                }
            )
            self.emit(
                {
                    "type": "response.content_part.done",
                    "item_id": mid,
                    "output_index": idx,
                    "content_index": 0,
                    "part": part,
                }
            )
            self.msg["status"] = item_status
            self.emit({"type": "response.output_item.done", "output_index": idx, "item": self.msg})
        for call in self.calls:
            self._emit_call(call, item_status)
        self.r["usage"] = usage(final)
        spent = reasoning_tokens(self.tokenizer, self.reasoning_text)
        self.r["usage"]["output_tokens_details"]["reasoning_tokens"] = spent
        self.r["completed_at"] = int(time.time())
        if error is not None:
            self.r["status"] = "failed"
            self.r["error"] = {"code": "server_error", "message": error}
            self.emit({"type": "error", "code": "server_error", "message": error, "param": None})
            self.emit({"type": "response.failed", "response": self.r})
        elif incomplete:
            self.r["status"] = "incomplete"
            self.r["incomplete_details"] = {"reason": "max_output_tokens"}
            self.emit({"type": "response.incomplete", "response": self.r})
        else:
            self.r["status"] = "completed"
            self.emit({"type": "response.completed", "response": self.r})

    def _emit_call(self, call: ToolCall, status: str) -> None:
        item = self.call_item(call, "in_progress")
        custom = item["type"] == "custom_tool_call"
        field, kind = (
            ("input", "custom_tool_call_input")
            if custom
            else ("arguments", "function_call_arguments")
        )
        text, item[field] = item[field], ""
        idx = len(self.r["output"])
        self.r["output"].append(item)
        self.emit({"type": "response.output_item.added", "output_index": idx, "item": item})
        where = {"item_id": item["id"], "output_index": idx}
        self.emit({"type": f"response.{kind}.delta", **where, "delta": text})
        item[field] = text
        done = {"type": f"response.{kind}.done", **where, field: text}
        if not custom:
            done["name"] = item["name"]
        self.emit(done)
        item["status"] = status
        self.emit({"type": "response.output_item.done", "output_index": idx, "item": item})

    def finish_empty(self, final: RequestOutput | None) -> None:
        """A warm-up (WebSocket `generate: false`): no output items, just completed."""
        self.r["usage"] = usage(final)
        self.r["completed_at"] = int(time.time())
        self.r["status"] = "completed"
        self.emit({"type": "response.completed", "response": self.r})

    def cancelled(self, last: RequestOutput | None, prompt_tokens: int) -> None:
        """Cancelled: the usage so far is what it is billed for (as in the ledger)."""
        self.r["usage"] = usage(last)
        if last is None:
            self.r["usage"]["input_tokens"] = self.r["usage"]["total_tokens"] = prompt_tokens
        self.r["status"] = "cancelled"
        self.r["completed_at"] = int(time.time())
