"""`StreamReader`: turns a streamed response's events into a `RequestRecord`'s fields.

The same events arrive over SSE (HTTP) and the Responses WebSocket mode. An output chunk is any
event that carries new output: Chat `delta.content` / reasoning / tool-call arguments, Responses
`*.delta` text, reasoning and function-call arguments (on both APIs a delta that only names a
call is not one). The reply kept for the next turn of a session is the visible text and the
tool calls: Chat `delta.tool_calls` fragments joined by their `index`, Responses
`function_call` items from `response.output_item.done` (or, if a server sends none, from the
final response's `output`). The finish reason is Chat's; a
Responses answer that completed is `tool_calls` (with calls) or `stop`, one cut short by
`max_output_tokens` is `length`, another incomplete one its reason.
"""

from __future__ import annotations

from typing import Any

from expresslane.bench.records import RequestRecord
from expresslane.bench.workloads import Reply, ToolCall

RESPONSES_CHUNKS = {
    "response.output_text.delta",
    "response.refusal.delta",
    "response.reasoning_text.delta",
    "response.reasoning_summary_text.delta",
    "response.function_call_arguments.delta",
}
RESPONSES_DONE = {"response.completed", "response.incomplete"}


def error_message(payload: Any) -> str:
    """The message of an OpenAI-shaped error (`{"error": {"message"}}`), else the payload."""
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    return str(payload)[:500]


class StreamReader:
    def __init__(self, rec: RequestRecord, api: str):
        self.rec = rec
        self.api = api
        self.parts: list[str] = []
        self.calls: dict[int, dict[str, str]] = {}  # by Chat index or Responses output order
        self.done = False  # a terminal event arrived

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def reply(self) -> Reply:
        calls = [
            ToolCall(c.get("id") or f"call_{i}", c.get("name", ""), c.get("arguments", ""))
            for i, c in sorted(self.calls.items())
        ]
        return Reply(self.text, calls)

    def _chat_calls(self, deltas: list[dict[str, Any]]) -> None:
        for n, d in enumerate(deltas):
            call = self.calls.setdefault(d.get("index", n), {})
            fn = d.get("function") or {}
            if d.get("id"):
                call["id"] = d["id"]
            if fn.get("name"):
                call["name"] = call.get("name", "") + fn["name"]
            if fn.get("arguments"):
                call["arguments"] = call.get("arguments", "") + fn["arguments"]

    def _responses_call(self, item: dict[str, Any]) -> None:
        if item.get("type") == "function_call":
            self.calls[len(self.calls)] = {
                "id": item.get("call_id") or item.get("id") or "",
                "name": item.get("name") or "",
                "arguments": item.get("arguments") or "",
            }

    def _chunk(self, now: float) -> None:
        if self.rec.first_token is None:
            self.rec.first_token = now
        self.rec.chunk_times.append(now)

    def fail(self, message: str, status: int | None = None) -> None:
        self.rec.error = message
        if status is not None:
            self.rec.status = status
        self.done = True

    def feed(self, event: dict[str, Any], now: float) -> None:
        if self.api == "chat":
            self._chat(event, now)
        else:
            self._responses(event, now)

    def _chat(self, event: dict[str, Any], now: float) -> None:
        if event.get("error"):
            self.fail(error_message(event))
            return
        new_output = False
        for choice in event.get("choices") or []:
            if choice.get("finish_reason"):
                self.rec.finish_reason = choice["finish_reason"]
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.parts.append(delta["content"])
                new_output = True
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            calls = delta.get("tool_calls") or []
            arguments = any((c.get("function") or {}).get("arguments") for c in calls)
            new_output = new_output or bool(reasoning) or arguments
            if calls:
                self._chat_calls(calls)
        if new_output:
            self._chunk(now)
        if event.get("service_tier"):
            self.rec.served_tier = event["service_tier"]
        usage = event.get("usage")
        if usage:
            self.rec.input_tokens = usage.get("prompt_tokens")
            self.rec.output_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            self.rec.cached_tokens = details.get("cached_tokens")

    def _responses(self, event: dict[str, Any], now: float) -> None:
        kind = event.get("type")
        if kind in RESPONSES_CHUNKS:
            if not event.get("delta"):
                return
            if kind == "response.output_text.delta":
                self.parts.append(event["delta"])
            self._chunk(now)
        elif kind == "response.output_item.done":
            self._responses_call(event.get("item") or {})
        elif kind == "error":
            self.fail(error_message(event), event.get("status"))
        elif kind == "response.failed":
            self._response(event.get("response") or {})
            self.fail(error_message(event.get("response") or event))
        elif kind in RESPONSES_DONE or kind in ("response.created", "response.in_progress"):
            self._response(event.get("response") or {})
            self.done = kind in RESPONSES_DONE
            if self.done:
                self._responses_end(kind, event.get("response") or {})

    def _responses_end(self, kind: str, response: dict[str, Any]) -> None:
        if not self.calls:
            for item in response.get("output") or []:
                self._responses_call(item)
        if kind == "response.completed":
            self.rec.finish_reason = "tool_calls" if self.calls else "stop"
        else:
            reason = (response.get("incomplete_details") or {}).get("reason")
            self.rec.finish_reason = "length" if reason == "max_output_tokens" else reason

    def _response(self, response: dict[str, Any]) -> None:
        if response.get("service_tier"):
            self.rec.served_tier = response["service_tier"]
        usage = response.get("usage")
        if usage:
            self.rec.input_tokens = usage.get("input_tokens")
            self.rec.output_tokens = usage.get("output_tokens")
            details = usage.get("input_tokens_details") or {}
            self.rec.cached_tokens = details.get("cached_tokens")
