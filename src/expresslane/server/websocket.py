"""Responses API WebSocket mode on `/v1/responses`.

The client sends `{"type": "response.create", ...create body...}` text frames; the server
answers with the same events as SSE (each echoing `stream_id` when one was given), one
response at a time: later messages queue in order. The connection keeps the conversation of
its latest response, so `previous_response_id` works with `store: false`; a failed
continuation evicts the id it continued from. Errors are `{"type": "error", "status",
"error": {type, code, message, param}}` and the socket stays open. After
`websocket_max_connection_seconds` the server sends `websocket_connection_limit_reached` and
closes (1000); a disconnect aborts the response in flight and frees its KV blocks. While the
server drains (`lifecycle.py`) a new message gets a 503 `server_shutting_down` error.
`previous_response_id` reaches only the key owner's stored responses (`resolve_previous`).

Messages wait in a bounded inbox: a client that sends more than
`websocket_max_queued_messages` ahead of the one running, or more bytes than a request body
may have (`max_body_bytes`), gets a `websocket_inbox_full` error and the connection is closed
(1008). Browsers do not apply CORS to WebSockets, so the Origin header is checked when the
connection opens (`_origin_allowed`): a page on another site cannot drive
an open server through its visitor's browser.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from urllib.parse import urlsplit

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from expresslane.server import body
from expresslane.server.database import DatabaseUnavailable
from expresslane.server.errors import (
    APIError,
    database_unavailable,
    internal_error,
    invalid,
    validation_error,
)
from expresslane.server.keys import OPEN_ACCESS_ID
from expresslane.server.lifecycle import refusal
from expresslane.server.response_job import create_job
from expresslane.server.schemas import WsResponseCreate
from expresslane.server.state import ServerState

router = APIRouter()
log = logging.getLogger("expresslane.server")
TRANSPORT_FIELDS = ("stream", "background", "stream_options")


class Connection:
    def __init__(self, state: ServerState, ws: WebSocket):
        self.state = state
        self.ws = ws
        self.deadline = time.monotonic() + state.settings.websocket_max_connection_seconds
        self.inbox: asyncio.Queue[str] = asyncio.Queue()
        self.max_queued = state.settings.websocket_max_queued_messages
        self.max_bytes = state.settings.max_body_bytes
        self.queued_bytes = 0
        self.local: dict[str, list[dict]] = {}  # latest response id -> its conversation

    async def send_error(self, err: APIError, extra: dict | None = None) -> None:
        body = err.body()["error"]
        await self.ws.send_text(
            json.dumps({"type": "error", "status": err.status, "error": body, **(extra or {})})
        )

    async def run(self) -> None:
        reader = asyncio.create_task(self._read())
        worker = asyncio.create_task(self._work())
        done, _ = await asyncio.wait({reader, worker}, return_when=asyncio.FIRST_COMPLETED)
        for task in (reader, worker):
            task.cancel()
        for task in (reader, worker):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _read(self) -> None:
        with contextlib.suppress(WebSocketDisconnect):
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                text = message.get("text")
                if text is None and message.get("bytes") is not None:
                    text = message["bytes"].decode("utf-8", "replace")
                if text is not None and not await self._queue(text):
                    return

    async def _queue(self, text: str) -> bool:
        """Put the message in the inbox; False (the connection is closed) if it is full."""
        size = len(text)
        if self.inbox.qsize() >= self.max_queued or self.queued_bytes + size > self.max_bytes:
            await self.send_error(
                invalid(
                    f"More than {self.max_queued} messages or {self.max_bytes} bytes were "
                    "sent ahead of the response running; wait for each response's last "
                    "event before sending more. The connection is closed.",
                    code="websocket_inbox_full",
                )
            )
            await self.ws.close(code=1008)
            return False
        self.queued_bytes += size
        self.inbox.put_nowait(text)
        return True

    async def _work(self) -> None:
        while True:
            remaining = self.deadline - time.monotonic()
            try:
                text = await asyncio.wait_for(self.inbox.get(), timeout=max(remaining, 0))
                self.queued_bytes -= len(text)
            except asyncio.TimeoutError:
                text = None
            if text is None or time.monotonic() >= self.deadline:
                minutes = self.state.settings.websocket_max_connection_seconds / 60
                await self.send_error(
                    invalid(
                        f"This WebSocket connection reached its {minutes:g}-minute limit; open a "
                        "new connection (continue a store=true chain by previous_response_id, or "
                        "resend the full conversation).",
                        code="websocket_connection_limit_reached",
                    )
                )
                await self.ws.close(code=1000)
                return
            await self._handle(text)

    async def _handle(self, text: str) -> None:
        received = time.perf_counter()
        extra: dict = {}
        data: dict = {}
        try:
            data = _message(text, extra)
            req = _response_create(data)
            if self.ws.app.state.lifecycle.draining:
                raise refusal()
            job = await create_job(
                self.state,
                req,
                key=self.ws.state.api_key,
                received=received,
                local=self.local,
                extra=extra,
                generate=req.generate is not False,
            )
            await job.start()
        except Exception as e:  # a bad or failing message must not cost the connection
            self._evict(data)
            await self.send_error(_as_api_error(e), extra)
            return
        try:
            async for _, event in job.log.follow():
                await self.ws.send_text(event)
        finally:
            job.cancel()
        await job.wait()
        if job.full_context is not None:
            self.local = {job.id: job.full_context}  # keep only the latest response
        else:
            self._evict(data)

    def _evict(self, data: dict) -> None:
        prev = data.get("previous_response_id")
        if isinstance(prev, str):
            self.local.pop(prev, None)


@router.websocket("/v1/responses")
async def responses_websocket(ws: WebSocket):
    if not _origin_allowed(ws):
        await ws.close(code=1008)  # before accepting: the handshake is refused with 403
        return
    await ws.accept()
    conn = Connection(ws.app.state.server, ws)
    try:
        await conn.run()
    except Exception:
        log.exception("WebSocket connection failed")
        with contextlib.suppress(Exception):
            await conn.send_error(internal_error())
            await ws.close(code=1011)


def _origin_allowed(ws: WebSocket) -> bool:
    """No Origin (not a browser), the server's own, one of `websocket_allowed_origins`; with
    that setting unset, any origin once API keys are configured (each connection needs one)."""
    origin = ws.headers.get("origin")
    if origin is None or urlsplit(origin).netloc.lower() == ws.headers.get("host", "").lower():
        return True
    allowed = ws.app.state.server.settings.websocket_allowed_origins
    if allowed is None:
        return ws.state.api_key.id != OPEN_ACCESS_ID
    return "*" in allowed or origin.rstrip("/") in {a.rstrip("/") for a in allowed}


def _message(text: str, extra: dict) -> dict:
    """The message as a JSON object; its `stream_id` (echoed on its events) into `extra`."""
    try:
        data = body.loads(text)
    except json.JSONDecodeError as e:
        raise invalid(f"Could not parse the message as JSON: {e}.", code="invalid_json") from e
    if not isinstance(data, dict):
        raise invalid("A message must be a JSON object.", code="invalid_type")
    if isinstance(data.get("stream_id"), str):
        extra["stream_id"] = data["stream_id"]
    return data


def _response_create(data: dict) -> WsResponseCreate:
    kind = data.get("type")
    if kind != "response.create":
        raise invalid(
            f"Unsupported message type {kind!r}; send 'response.create'.",
            param="type",
            code="unsupported_event_type",
        )
    fields = {k: v for k, v in data.items() if k not in TRANSPORT_FIELDS}
    try:
        return WsResponseCreate.model_validate(fields)
    except ValidationError as e:
        raise validation_error(list(e.errors(include_url=False))) from e


def _as_api_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, DatabaseUnavailable):
        log.warning("WebSocket message: %s", e)
        return database_unavailable()
    log.error("WebSocket message failed", exc_info=e)
    return internal_error()
