"""Transports: how a session's requests reach the server (HTTP+SSE or the Responses WebSocket
mode). A transport hands out one `Sender` per session; over WebSocket a session keeps one
connection for all its turns."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from expresslane.bench.records import RequestRecord
from expresslane.bench.workloads import Reply, Turn

Clock = Callable[[], float]  # seconds since the run started
Sender = Callable[[list[dict[str, Any]], Turn, RequestRecord, Clock], Awaitable[Reply]]


class Transport(Protocol):
    def session(self) -> AbstractAsyncContextManager[Sender]: ...

    async def aclose(self) -> None: ...
