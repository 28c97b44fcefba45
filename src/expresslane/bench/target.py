"""`Target`: the endpoint under test and the shape of the requests sent to it.

`base_url` may be given with or without the trailing `/v1` (`http://host:8000` and
`http://host:8000/v1` are the same target). Bodies carry `service_tier` only when one is given,
so endpoints that don't know the field still work.

Conversations are kept Chat-shaped; for the Responses API, an assistant message with
`tool_calls` becomes its text plus `function_call` items and a `role: tool` message becomes a
`function_call_output` item (other items pass through unchanged).

A turn's output format goes to Chat `response_format` (a `json_schema` nested under
`json_schema`) or Responses `text.format` (flat); a named `tool_choice` is
`{"type": "function", "function": {"name"}}` on Chat and `{"type": "function", "name"}` on
Responses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from expresslane.bench.workloads import Turn

Api = Literal["chat", "responses"]
TransportName = Literal["http", "websocket"]


@dataclass
class Target:
    base_url: str
    model: str | None = None
    api: Api = "responses"
    transport: TransportName = "http"
    api_key: str | None = None
    tier: str | None = None
    max_retries: int = 3
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def api_root(self) -> str:
        root = self.base_url.rstrip("/")
        return root if root.endswith("/v1") else root + "/v1"

    def url(self, path: str) -> str:
        return f"{self.api_root}/{path.lstrip('/')}"

    @property
    def ws_url(self) -> str:
        url = self.url("responses")
        return "ws" + url[4:] if url.startswith("http") else url

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, messages: list[dict[str, Any]], turn: Turn) -> dict[str, Any]:
        """The streamed request body for this target's API."""
        body: dict[str, Any] = {"model": self.model, "stream": True}
        if self.api == "chat":
            body["messages"] = messages
            body["max_tokens"] = turn.max_tokens
            body["stream_options"] = {"include_usage": True}
            if turn.tools:
                body["tools"] = [{"type": "function", "function": t} for t in turn.tools]
            if turn.response_format:
                body["response_format"] = chat_format(turn.response_format)
            if isinstance(turn.tool_choice, dict):
                body["tool_choice"] = {"type": "function", "function": turn.tool_choice}
        else:
            body["input"] = responses_input(messages)
            body["max_output_tokens"] = turn.max_tokens
            if turn.tools:
                body["tools"] = [{"type": "function", **t} for t in turn.tools]
            if turn.response_format:
                body["text"] = {"format": turn.response_format}
            if isinstance(turn.tool_choice, dict):
                body["tool_choice"] = {"type": "function", **turn.tool_choice}
        if isinstance(turn.tool_choice, str):
            body["tool_choice"] = turn.tool_choice
        if self.tier:
            body["service_tier"] = self.tier
        body.update(self.extra_body)
        body.update(turn.extra)
        return body


def chat_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """A Responses-shaped output format as Chat's `response_format`."""
    if fmt["type"] != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def responses_input(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat-shaped tool calls and tool results as Responses input items."""
    items: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            if m.get("content"):
                items.append({"role": "assistant", "content": m["content"]})
            for c in m["tool_calls"]:
                fn = c["function"]
                items.append(
                    {
                        "type": "function_call",
                        "call_id": c["id"],
                        "name": fn["name"],
                        "arguments": fn["arguments"],
                    }
                )
        elif m.get("role") == "tool":
            call_id, output = m["tool_call_id"], m["content"]
            items.append({"type": "function_call_output", "call_id": call_id, "output": output})
        else:
            items.append(m)
    return items
