"""Graceful stop: on the first SIGTERM (or SIGINT) the server drains.

While draining, `/health` still answers 200 (the process is alive) but `/ready` answers 503, and
new work (POST /v1/responses, /v1/chat/completions, /v1/completions, and new WebSocket messages)
gets 503 `server_shutting_down`; everything else (retrieving, cancelling, deleting) still works.
Requests in flight and running responses (background ones too) get `graceful_shutdown_seconds`
to finish; the responses still running then end `incomplete` with their output so far, stored
and billed (`durability.SHUT_DOWN`), and the server exits. A second signal stops it at once.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from expresslane.server.durability import SHUT_DOWN
from expresslane.server.errors import BUSY_HEADERS, APIError, response_for
from expresslane.server.state import ServerState

NEW_WORK = frozenset({"/v1/responses", "/v1/chat/completions", "/v1/completions", "/v1/messages"})
POLL_S = 0.05


class Lifecycle:
    """Whether the server takes new work, and how many HTTP requests are in flight.
    `saturated()` is true when every lane's queue is full: new work is then shed with 429
    before its body is even read, so refusing a flood costs the engine as little as it can."""

    def __init__(self, saturated: Callable[[], bool] = lambda: False) -> None:
        self.draining = False
        self.active = 0
        self.saturated = saturated


def shed() -> APIError:
    return APIError(
        429,
        "Every tier of this server has as many requests running or waiting as it queues; "
        "retry after the Retry-After delay.",
        code="queue_full",
        headers=BUSY_HEADERS,
    )


def refusal() -> APIError:
    return APIError(
        503,
        "The server is shutting down and takes no new requests; send this one to another "
        "instance, or retry once it is back.",
        code="server_shutting_down",
        headers={"retry-after": "1"},
    )


def readiness(state: ServerState, lifecycle: Lifecycle) -> str | None:
    """None if the server takes work, else why not."""
    engine = state.engine
    if lifecycle.draining:
        return "draining"
    if not engine.is_alive():
        return "engine stopped"
    if not engine.ready.is_set():
        return "starting"
    return None


class DrainGate:
    """ASGI middleware: counts /v1 HTTP requests in flight; refuses new work while draining."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle):
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        new_work = scope["method"] == "POST" and scope["path"].rstrip("/") in NEW_WORK
        if self.lifecycle.draining and new_work:
            await response_for(scope["path"], refusal())(scope, receive, send)
            return
        if new_work and self.lifecycle.saturated():
            await response_for(scope["path"], shed())(scope, receive, send)
            return
        self.lifecycle.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.active -= 1


def _running(state: ServerState) -> list:
    return [j for j in state.jobs.values() if j.task is not None and not j.task.done()]


async def interrupt_all(state: ServerState) -> None:
    """End every running response as interrupted by the shutdown, and wait for them."""
    jobs = _running(state)
    for job in jobs:
        job.interrupt(SHUT_DOWN)
    if jobs:
        await asyncio.wait({j.task for j in jobs})


async def drain(state: ServerState, lifecycle: Lifecycle, seconds: float) -> None:
    """Refuse new work, wait up to `seconds` for what is in flight, interrupt the rest."""
    lifecycle.draining = True
    deadline = time.monotonic() + seconds
    while (lifecycle.active or _running(state)) and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    await interrupt_all(state)


class DrainingServer(uvicorn.Server):
    """uvicorn that drains (see `drain`) on the first SIGINT/SIGTERM before shutting down."""

    def __init__(self, config: uvicorn.Config, state: ServerState, lifecycle: Lifecycle):
        super().__init__(config)
        self.state = state
        self.lifecycle = lifecycle
        self.grace = state.settings.graceful_shutdown_seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        drainable = sig in (signal.SIGINT, signal.SIGTERM) and self._loop is not None
        if self._draining or self.should_exit or not drainable:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        try:
            await drain(self.state, self.lifecycle, self.grace)
        finally:
            self.should_exit = True
