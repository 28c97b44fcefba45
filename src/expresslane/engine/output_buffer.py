"""`OutputBuffer`: one request's outputs between the code that receives them (on the event
loop) and the task that streams them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from expresslane.engine.output import RequestOutput, merge_outputs


class OutputBuffer:
    """`put` an output as it arrives; `take` waits for outputs and returns all that came, as
    one (a reader that fell behind catches up in one piece). Nothing is kept after a finished
    output. A list and a future: an asyncio.Queue cost twice as much per streamed token, much
    of it looking the running loop up on every call (a getpid system call on Python 3.11).
    `watch` sees each output as it arrives, however slowly (or whether) it is taken."""

    def __init__(self):
        self._outputs: list[RequestOutput] = []
        self._arrived: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.ended = False  # the finished output was put
        self.watch: Callable[[RequestOutput], None] | None = None

    def put(self, out: RequestOutput) -> None:
        if self.ended:
            return
        self.ended = out.finished
        if self.watch is not None:
            self.watch(out)
        self._outputs.append(out)
        if self._arrived is not None and not self._arrived.done():
            self._arrived.set_result(None)

    async def take(self) -> RequestOutput:
        if not self._outputs:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._arrived = self._loop.create_future()
            await self._arrived
        outputs, self._outputs = self._outputs, []
        return merge_outputs(outputs)
