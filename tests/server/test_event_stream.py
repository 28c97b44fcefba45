"""`EventStream` runs its `on_close` (which aborts the generation) however the stream ends,
also when the client leaves before its first event."""

from __future__ import annotations

import asyncio

import pytest

from expresslane.server.sse import EventStream


async def _events():
    yield "data: 1\n\n"


async def test_a_client_leaving_while_the_start_waits_aborts_the_generation():
    """As a fleet's start waits for a replica to take the request: Starlette cancels the
    response when the client disconnects."""
    closed, started = [], asyncio.Event()

    async def send(message):
        if message["type"] == "http.response.start":
            started.set()
            await asyncio.Event().wait()

    stream = EventStream(_events(), on_close=lambda: closed.append("closed"))
    task = asyncio.ensure_future(stream.stream_response(send))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closed == ["closed"]


async def test_a_start_that_fails_aborts_the_generation():
    closed = []

    async def send(message):
        raise OSError("the client is gone")

    stream = EventStream(_events(), on_close=lambda: closed.append("closed"))
    with pytest.raises(OSError):
        await stream.stream_response(send)
    assert closed == ["closed"]


async def test_a_stream_that_ends_closes_once():
    closed, sent = [], []

    async def send(message):
        sent.append(message)

    await EventStream(_events(), on_close=lambda: closed.append("closed")).stream_response(send)
    assert closed == ["closed"]
    assert [m.get("body") for m in sent] == [None, b"data: 1\n\n", b""]
