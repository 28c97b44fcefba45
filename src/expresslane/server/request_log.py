"""One log line per finished HTTP request, and an `x-request-id` on every response.

`RequestLog` is the outermost ASGI middleware: it sees every answer, 401s and 503s included.
A client's `x-request-id` (printable ASCII, at most 128 characters) is kept, else one is
made; either way it is echoed on the response and left in the request's state
(`request.state.request_id`). The line carries the method, path, status and duration, and, for
a request that reached the engine, the key's name, the tier asked for and the tier that served
it, tokens in/cached/out, queue time, TTFT, decode speed and end-to-end time (from the
request's `Ticket`, filled in when its generations end). Probes and metrics scrapes (/health,
/ready, /metrics) and static files are logged at DEBUG, everything else at INFO.

`configure_logging` sets the format of every log line: text, or one JSON object per line.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from expresslane.server.sse import SERVER_SEND

access = logging.getLogger("expresslane.access")
QUIET_PATHS = ("/health", "/ready", "/metrics", "/playground/", "/static-offline-docs/")
MAX_ID_CHARS = 128


def request_id(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name.lower() == b"x-request-id":
            text = value.decode("latin-1")
            if 0 < len(text) <= MAX_ID_CHARS and text.isascii() and text.isprintable():
                return text
            break
    return uuid.uuid4().hex


class RequestLog:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        rid = request_id(scope["headers"])
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        scope.setdefault(SERVER_SEND, send)
        status = 500  # what the client gets if the app raises before answering

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [h for h in message.get("headers", []) if h[0] != b"x-request-id"]
                headers.append((b"x-request-id", rid.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            fields = request_fields(scope, status, time.perf_counter() - started)
            level = logging.DEBUG if scope["path"].startswith(QUIET_PATHS) else logging.INFO
            access.log(level, format_text(fields), extra={"fields": fields})


def request_fields(scope: Scope, status: int, seconds: float) -> dict:
    state = scope.get("state", {})
    fields: dict = {
        "method": scope["method"],
        "path": scope["path"],
        "status": status,
        "duration_s": round(seconds, 4),
        "request_id": state.get("request_id"),
    }
    key = state.get("api_key")
    if key is not None:
        fields["key"] = key.name if key.id != "local" else "local"
    ticket = state.get("ticket")
    if ticket is not None:
        fields["tier_requested"] = ticket.tier_requested
        fields["tier"] = ticket.lane
        usage = getattr(ticket, "usage", None) or {}
        fields.update({k: round(v, 4) if isinstance(v, float) else v for k, v in usage.items()})
        decode_s, out = usage.get("decode_s"), usage.get("output_tokens")
        if decode_s and out and out > 1:
            # the first token comes at TTFT: the decode phase makes the other out - 1
            fields["decode_tokens_per_s"] = round((out - 1) / decode_s, 1)
    return fields


def format_text(f: dict) -> str:
    parts = [f"{f['method']} {f['path']} {f['status']} {f['duration_s']:.3f}s"]
    parts.append(f"id={f['request_id']}")
    if "key" in f:
        parts.append(f"key={f['key']}")
    if "tier" in f:
        asked = f["tier_requested"]
        parts.append(f"tier={f['tier']}" if asked == f["tier"] else f"tier={asked}->{f['tier']}")
    if "output_tokens" in f:
        tokens = f"{f.get('input_tokens', 0)}/{f.get('cached_tokens', 0)}/{f['output_tokens']}"
        parts.append(f"tokens={tokens}")
    for name, label in (("queue_s", "queue"), ("ttft_s", "ttft"), ("e2e_s", "e2e")):
        if f.get(name) is not None:
            parts.append(f"{label}={f[name]:.3f}s")
    if "decode_tokens_per_s" in f:
        parts.append(f"decode={f['decode_tokens_per_s']:.1f}tok/s")
    return " ".join(parts)


class JsonFormatter(logging.Formatter):
    """A JSON object per record: time, level, logger, message, and a request line's fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        doc.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Every log line (uvicorn's too, which must then run with log_config=None) to stderr."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
