"""The Responses API WebSocket mode: `WsTransport` keeps one connection per session (idle
connections are reused by later sessions) and sends each turn as a `response.create` message,
reading events until `response.completed` / `response.incomplete` / `response.failed` / `error`.

Opening a connection happens inside the first request that needs it, so its time counts in
that request's latency (as a new HTTP connection's does). A record's `headers` time is the
first event received. An `error` event with a retryable status is retried like HTTP (no
headers here, so with backoff); a dropped connection is an error, and the session's next
turn opens a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus, WebSocketException

from expresslane.bench.events import StreamReader
from expresslane.bench.records import RequestRecord
from expresslane.bench.retry import retry_wait, should_retry
from expresslane.bench.target import Target
from expresslane.bench.transport import Clock, Sender
from expresslane.bench.workloads import Reply, Turn

TRANSPORT_FIELDS = ("stream", "stream_options", "background")


class WsSession:
    """One session's connection, opened on first use and reopened after a failure."""

    def __init__(self, transport: WsTransport):
        self.transport = transport
        self.conn: ClientConnection | None = None

    async def _turn(self, message: str, rec: RequestRecord, clock: Clock) -> Reply:
        target = self.transport.target
        reader = StreamReader(rec, "responses")
        if self.conn is None:
            self.conn = await self.transport.acquire()
        await self.conn.send(message)
        while not reader.done:
            raw = await asyncio.wait_for(self.conn.recv(), target.timeout_s)
            now = clock()
            if rec.headers is None:
                rec.headers = now
                rec.status = 200
            reader.feed(json.loads(raw), now)
        return reader.reply

    async def send(
        self, messages: list[dict[str, Any]], turn: Turn, rec: RequestRecord, clock: Clock
    ) -> Reply:
        target = self.transport.target
        body = target.body(messages, turn)
        for name in TRANSPORT_FIELDS:
            body.pop(name, None)
        message = json.dumps({"type": "response.create", **body})
        rec.sent = clock()
        reply = Reply()
        while True:
            try:
                reply = await self._turn(message, rec, clock)
            except InvalidStatus as e:
                rec.status = e.response.status_code
                rec.error = f"WebSocket handshake: HTTP {rec.status}"
            except (WebSocketException, OSError, asyncio.TimeoutError, ValueError) as e:
                rec.error = f"{type(e).__name__}: {e}"
                await self.drop()
            rec.end = clock()
            retry = rec.error is not None and should_retry(rec.status)
            if not retry or rec.retries >= target.max_retries:
                return reply
            await asyncio.sleep(retry_wait(rec.retries + 1))
            rec.retries += 1
            rec.reset_attempt()

    async def drop(self) -> None:
        if self.conn is not None:
            conn, self.conn = self.conn, None
            await self.transport.discard(conn)


class WsTransport:
    def __init__(self, target: Target):
        self.target = target
        self.idle: list[ClientConnection] = []
        self.all: set[ClientConnection] = set()

    async def acquire(self) -> ClientConnection:
        if self.idle:
            return self.idle.pop()
        conn = await connect(
            self.target.ws_url,
            additional_headers=self.target.headers(),
            max_size=None,
            compression=None,
            open_timeout=self.target.timeout_s,
        )
        self.all.add(conn)
        return conn

    async def discard(self, conn: ClientConnection) -> None:
        self.all.discard(conn)
        with contextlib.suppress(Exception):  # a broken connection has nothing to clean up
            await conn.close()

    @asynccontextmanager
    async def session(self) -> AsyncIterator[Sender]:
        s = WsSession(self)
        try:
            yield s.send
        except BaseException:
            await s.drop()  # a response may still be in flight on it
            raise
        if s.conn is not None:
            self.idle.append(s.conn)

    async def aclose(self) -> None:
        for conn in list(self.all):
            await self.discard(conn)
        self.idle.clear()
