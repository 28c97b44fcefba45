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

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(name: str | None, data: str | dict) -> str:
    body = data if isinstance(data, str) else json.dumps(data)
    return (f"event: {name}\n" if name else "") + f"data: {body}\n\n"


DONE = "data: [DONE]\n\n"


def sse_response(
    chunks: AsyncIterator[str], on_close: Callable[[], None] | None = None
) -> StreamingResponse:
    async def body():
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            if on_close is not None:
                on_close()

    return StreamingResponse(body(), media_type="text/event-stream", headers=HEADERS)


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
