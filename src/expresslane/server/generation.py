"""One engine request as the server runs it: build sampling params, iterate outputs, record
metrics, abort on demand. Requests are made and started by `admission.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable

from expresslane.engine.output import RequestOutput
from expresslane.engine.protocol import PreparedRequest
from expresslane.errors import ExpresslaneError
from expresslane.sampling_params import SamplingParams
from expresslane.server.accounts import Ticket
from expresslane.server.errors import from_engine_error, invalid
from expresslane.server.sse import until_disconnected
from expresslane.server.state import ServerState

log = logging.getLogger("expresslane.server")


# Sampling fields every endpoint's request body names the same way as SamplingParams.
SHARED_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "repetition_penalty",
    "min_p",
)


def with_model_defaults(body, defaults: dict):
    """`body` with the model's generation-config settings (`ServingEngine.sampling_defaults`)
    in the shared sampling fields it leaves unset, as vLLM applies them; echoed as used."""
    shared = {k: v for k, v in defaults.items() if k in SHARED_SAMPLING_FIELDS}
    update = {k: v for k, v in shared.items() if getattr(body, k) is None}
    return body.model_copy(update=update) if update else body


def make_params(api: str, body=None, **kwargs) -> SamplingParams:
    """SamplingParams from the body's shared sampling fields plus the non-None keyword
    arguments; errors name the fields as the `api` does (`errors.API_FIELDS`). `max_tokens=None`
    is kept: no limit but the context (Chat's and Responses' default), not SamplingParams' 16."""
    if body is not None:
        kwargs = {**{f: getattr(body, f) for f in SHARED_SAMPLING_FIELDS}, **kwargs}
    try:
        given = {k: v for k, v in kwargs.items() if v is not None or k == "max_tokens"}
        return SamplingParams(**given)
    except ExpresslaneError as e:
        raise from_engine_error(e, api) from e


def openai_penalties(body) -> dict:
    """Chat's and Completions' presence_penalty, frequency_penalty and logit_bias as
    SamplingParams takes them: logit_bias keys are token ids written as strings."""
    bias = None
    if body.logit_bias:
        bias = {}
        for key, value in body.logit_bias.items():
            if not (key.isascii() and key.isdigit()):
                raise invalid(
                    f"'logit_bias' keys must be token ids written as strings, got {key!r}.",
                    param="logit_bias",
                )
            bias[int(key)] = value
    return {
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "logit_bias": bias,
    }


class Generation:
    """One engine request: streams its outputs, records metrics, and writes its ledger row
    when it ends (finished, failed or cancelled).

    The meter watches the engine, not the client: its times are when the engine handed each
    output to the server (`_arrived`), however slowly the client reads, and its row bills
    what the engine generated, also for a request the client dropped."""

    def __init__(
        self,
        state: ServerState,
        req: PreparedRequest,
        ticket: Ticket,
        estimate: int,
        received: float,
        bills_prompt: bool = True,
    ):
        self.state = state
        # n choices of one prompt bill the prompt once, as the usage they report does
        self.bills_prompt = bills_prompt
        self.ticket = ticket
        self.lane = ticket.lane
        self.request = req
        self.request_id = req.request_id
        self.estimate = estimate  # tokens charged to the rate limit up front
        self.received = received
        self.first_token: float | None = None  # when the engine handed over the first token
        self._previous: float | None = None  # ... and the latest
        self.final: RequestOutput | None = None  # the engine's last output, once it came
        self.generated: RequestOutput | None = None  # the engine's latest output
        self.last: RequestOutput | None = None  # the latest output read
        self.aborted: str | None = None  # why the server stopped it: "abort", "interrupted"
        self.metered = False
        self.spent: RequestOutput | None = None  # what its ledger row billed, once written
        self.stream = state.engine.enqueue(req, ticket.regions)
        self.stream.watch(self._arrived)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        async for out in self.stream:
            self.last = out
            yield out

    def _arrived(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        self.generated = out
        if out.new_token_ids:
            if self.first_token is None:
                self.first_token = now
            elif self._previous is not None:
                self.state.metrics.observe_gap(
                    self.lane, now - self._previous, len(out.new_token_ids)
                )
            self._previous = now
        if out.finished:
            self.final = out
            self._end(out.finish_reason or "stop", now)

    def abort(self, status: str = "abort") -> None:
        """Stop the request (client gone, cancelled; `status` "interrupted" when the server
        stops it); its KV blocks are freed before the engine's next step, and its ledger row
        bills what the engine had generated by now, read or not. Safe to call more than once,
        or after it finished."""
        if self.final is not None or self.aborted:
            return
        self.aborted = status
        self.state.engine.abort(self.request_id)
        self._end(status, time.perf_counter())

    def _end(self, reason: str, now: float) -> None:
        if self.metered:
            return
        self.metered = True
        self.spent = self._spent()
        metrics = self.state.metrics
        if self.final is None:
            metrics.observe_aborted(self.lane, self.spent)
        else:
            metrics.observe_finished(self.lane, self.received, self.first_token, now, self.final)
        try:
            self._write_ledger(reason, now)
        except Exception:  # metering must never break the answer the client is getting
            log.exception("could not write the ledger row of %s", self.request_id)

    def _spent(self) -> RequestOutput | None:
        """The engine's latest output, counting every token it generated: where this process
        runs the engine, the live request's count (tokens not handed over yet included)."""
        out = self.final or self.generated
        if out is None or out.finished:
            return out
        made = max(out.num_output_tokens, self.request.num_output_tokens)
        return dataclasses.replace(out, num_output_tokens=made)

    def _write_ledger(self, status: str, now: float) -> None:
        out, req = self.spent, self.request
        first = self.first_token
        queue = out.metrics.queue_time if out is not None else None
        row = self.state.accounts.finish(
            self.ticket,
            self.request_id,
            self.state.model_name,
            status=status,
            input_tokens=req.num_prompt_tokens if self.bills_prompt else 0,
            cached_tokens=out.num_cached_tokens if out is not None and self.bills_prompt else 0,
            output_tokens=out.num_output_tokens if out is not None else 0,
            estimated_tokens=self.estimate,
            timings={
                "queue_s": queue,
                "ttft_s": None if first is None else first - self.received,
                "decode_s": None if first is None else now - first,
                "e2e_s": now - self.received,
            },
        )
        if row.promise_kept is not None:
            self.state.metrics.promises.observe(self.lane, self.ticket.key.id, row)


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


async def collect(request, gens: list[Generation], add: Callable[[int, RequestOutput], None]):
    """Every output of `gens` to `add(index, output)` until all finish; False when the client
    left first (the caller answers 499; the generations are aborted)."""

    async def run() -> None:
        async for i, out in merged(gens):
            add(i, out)

    task = asyncio.ensure_future(run())
    if not await until_disconnected(request, task):
        return False
    task.result()
    return True


def abort_all(gens: list[Generation]) -> None:
    for g in gens:
        g.abort()
