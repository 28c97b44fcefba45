"""One streamed HTTP request (Chat Completions or Responses over SSE) filling a record, and
`HttpTransport`, which shares one connection pool among all requests of a run.

Failures never raise: the record gets `status` and `error`, and the run goes on. Retryable
statuses (see `retry.py`) are retried up to `target.max_retries` times; the wait counts in the
request's latency, as a client would feel it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from expresslane.bench.events import StreamReader, error_message
from expresslane.bench.records import RequestRecord
from expresslane.bench.retry import retry_wait, should_retry
from expresslane.bench.target import Target
from expresslane.bench.transport import Clock, Sender
from expresslane.bench.workloads import Reply, Turn


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The `data` of each server-sent event (multi-line data joined by newlines)."""
    lines: list[str] = []
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            lines.append(line[5:].removeprefix(" "))
        elif not line and lines:
            yield "\n".join(lines)
            lines = []
    if lines:
        yield "\n".join(lines)


async def _attempt(
    client: httpx.AsyncClient,
    target: Target,
    body: dict[str, Any],
    rec: RequestRecord,
    clock: Clock,
) -> tuple[Reply, httpx.Headers | None]:
    """One attempt; returns the assistant's reply and, when it may be retried, the headers."""
    path = "chat/completions" if target.api == "chat" else "responses"
    reader = StreamReader(rec, target.api)
    try:
        async with client.stream(
            "POST", target.url(path), json=body, headers=target.headers()
        ) as resp:
            rec.headers = clock()
            rec.status = resp.status_code
            rec.pool = resp.headers.get("x-expresslane-pool")
            rec.replica = resp.headers.get("x-expresslane-replica")
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    payload: Any = json.loads(raw)
                except ValueError:
                    payload = raw.decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {error_message(payload)}"
                rec.end = clock()
                return Reply(), resp.headers
            async for data in sse_data(resp):
                if data.strip() == "[DONE]":
                    reader.done = True
                    break
                reader.feed(json.loads(data), clock())
                if reader.done:
                    break
    except (httpx.HTTPError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.end = clock()
    if rec.error is None and not reader.done:
        rec.error = "the stream ended before the response was complete"
    return reader.reply, None


async def send_http(
    client: httpx.AsyncClient,
    target: Target,
    messages: list[dict[str, Any]],
    turn: Turn,
    rec: RequestRecord,
    clock: Clock,
) -> Reply:
    """Send one streamed request, retrying as allowed; returns the assistant's reply."""
    body = target.body(messages, turn)
    rec.sent = clock()
    while True:
        reply, headers = await _attempt(client, target, body, rec, clock)
        if headers is None or rec.retries >= target.max_retries:
            break
        if not should_retry(rec.status, headers):
            break
        await asyncio.sleep(retry_wait(rec.retries + 1, headers))
        rec.retries += 1
        rec.reset_attempt()
    return reply


class HttpTransport:
    def __init__(self, target: Target):
        self.target = target
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.client = httpx.AsyncClient(timeout=target.timeout_s, limits=limits)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[Sender]:
        async def send(messages, turn: Turn, rec: RequestRecord, clock: Clock) -> Reply:
            return await send_http(self.client, self.target, messages, turn, rec, clock)

        yield send

    async def aclose(self) -> None:
        await self.client.aclose()
