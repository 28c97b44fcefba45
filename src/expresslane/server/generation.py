"""One engine request as the server runs it: build sampling params, submit (bad input raises
an `APIError` before anything is streamed), iterate outputs, record metrics, abort on demand.

Engine parameter names are mapped back to the endpoint's field names in error messages
(e.g. `max_tokens` -> `max_output_tokens` for the Responses API).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from expresslane.engine.output import RequestOutput
from expresslane.errors import ExpresslaneError
from expresslane.sampling_params import SamplingParams
from expresslane.server.errors import APIError, from_engine_error
from expresslane.server.state import ServerState
from expresslane.server.tiers import lane_rank


def make_params(names: dict[str, str], **kwargs) -> SamplingParams:
    """SamplingParams from the non-None keyword arguments; errors name the API's fields."""
    try:
        return SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})
    except ExpresslaneError as e:
        raise from_engine_error(e, names) from e


class Generation:
    def __init__(
        self,
        state: ServerState,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        tier: str,
        request_id: str,
        names: dict[str, str],
        received: float,
        add_special_tokens: bool = True,
    ):
        self.state = state
        self.tier = tier
        self.request_id = request_id
        self.received = received
        self.first_token: float | None = None
        self.final: RequestOutput | None = None
        self.aborted = False
        self.last: RequestOutput | None = None
        try:
            self.stream = state.engine.submit(
                prompt,
                params,
                request_id=request_id,
                priority=lane_rank(tier),
                add_special_tokens=add_special_tokens,
            )
        except ExpresslaneError as e:
            raise from_engine_error(e, names) from e
        except ValueError as e:
            raise APIError(400, str(e)) from e

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        last = None
        metrics = self.state.metrics
        async for out in self.stream:
            now = time.perf_counter()
            if out.new_token_ids:
                if self.first_token is None:
                    self.first_token = now
                elif last is not None:
                    metrics.observe_gap(self.tier, now - last, len(out.new_token_ids))
                last = now
            self.last = out
            if out.finished:
                self.final = out
                metrics.observe_finished(self.tier, self.received, self.first_token, now, out)
            yield out

    def abort(self) -> None:
        """Stop the request (client gone, cancelled); its KV blocks are freed before the
        engine's next step. Safe to call more than once, or after it finished."""
        if self.final is None and not self.aborted:
            self.aborted = True
            self.state.engine.abort(self.request_id)
            self.state.metrics.observe_aborted(self.tier, self.last)


async def merged(gens: list[Generation]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several generations (n > 1, batched prompts) as they come: (index, output).
    Closing the iterator early aborts the generations still running."""
    if len(gens) == 1:
        try:
            async for out in gens[0]:
                yield 0, out
        finally:
            gens[0].abort()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out))
        except BaseException as e:  # surface failures to the reader
            queue.put_nowait((i, e))
            raise

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(gens)
    try:
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                remaining -= 1
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for gen in gens:
            gen.abort()


def submit_all(
    state: ServerState, prompts: list, params: list[SamplingParams], **kwargs
) -> list[Generation]:
    """Submit several requests; if one is rejected, abort the ones already submitted."""
    gens: list[Generation] = []
    base = kwargs.pop("request_id")
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            gens.append(Generation(state, prompt, p, request_id=f"{base}-{i}", **kwargs))
    except BaseException:
        for g in gens:
            g.abort()
        raise
    return gens
