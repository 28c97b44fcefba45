"""`EventLog`: the events of one response as they are made, for any number of readers (the SSE
writer, a WebSocket, a resumed background stream), each from where it wants to start."""

from __future__ import annotations

import asyncio
import json


class EventLog:
    """Events of one response as (type, JSON text), numbered from 0; readers follow it."""

    def __init__(self, extra: dict | None = None):
        self.events: list[tuple[str, str]] = []
        self.closed = False
        self.extra = extra or {}
        self._changed = asyncio.Event()

    def emit(self, event: dict) -> None:
        event = {**event, "sequence_number": len(self.events), **self.extra}
        self.events.append((event["type"], json.dumps(event)))
        self._notify()

    def close(self) -> None:
        self.closed = True
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int = -1):
        i = after + 1
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.closed:
                return
            await self._changed.wait()
