"""Server-sent events and client-disconnect handling.

A streamed request stops when its client goes away: the SSE generator is closed (Starlette
cancels it, or the next write fails) and its `on_close` aborts the generation. A non-streamed
request is watched with `until_disconnected`, which cancels the work if the client leaves.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(name: str | None, data: str | dict) -> str:
    body = data if isinstance(data, str) else json.dumps(data)
    return (f"event: {name}\n" if name else "") + f"data: {body}\n\n"


DONE = "data: [DONE]\n\n"


class ChunkEvents:
    """The events of a streamed Chat Completions or Completions response: each chunk is the
    response's fields (`base`, encoded once) around one choice, and `"usage": null` while
    usage is asked for at the end."""

    def __init__(self, base: dict, include_usage: bool):
        head = json.dumps({**base, "choices": None})
        self._head = "data: " + head[: -len("null}")] + "["
        self._tail = "]" + (', "usage": null' if include_usage else "") + "}\n\n"

    def event(self, choice: dict) -> str:
        return self._head + json.dumps(choice) + self._tail


# The scope key under which the outermost middleware leaves the ASGI server's own `send`
# (request_log.py; fleet/ingress.py, which wraps the app): a stream's events go to it directly.
SERVER_SEND = "expresslane.server_send"


class EventStream(StreamingResponse):
    """A text/event-stream response. Its start and its end pass through every middleware; the
    events between go straight to the server's `send` (`SERVER_SEND`), since this app's
    middleware only add headers to a response's start: through them each event cost six
    wrapper calls, a tenth of the event loop's time per streamed token in the fleet's ingress.
    `on_close` runs when the events end, run out or interrupted (the client left)."""

    def __init__(self, chunks: AsyncIterator[str], on_close: Callable[[], None] | None = None):
        super().__init__(chunks, media_type="text/event-stream", headers=HEADERS)
        self.on_close = on_close
        self.server_send: Send | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.server_send = scope.get(SERVER_SEND)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        direct = self.server_send or send
        try:
            # (inside: a fleet's start waits for a replica to take the request, and a client
            # that leaves meanwhile must still abort it)
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            async for chunk in self.body_iterator:
                event = {"type": "http.response.body", "body": chunk.encode(), "more_body": True}
                await direct(event)
        finally:
            if self.on_close is not None:
                self.on_close()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def until_disconnected(request: Request, task: asyncio.Future, poll_s: float = 0.2) -> bool:
    """Wait for `task`; if the client disconnects first, cancel it. True if it finished."""
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return True
        if await request.is_disconnected():
            task.cancel()
            await asyncio.wait({task})
            return False
