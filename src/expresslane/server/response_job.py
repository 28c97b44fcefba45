"""One Responses API request from validation to its stored result, shared by HTTP, SSE,
background mode and WebSocket mode.

`create_job` admits the request (`admission.py`: `check` is this API's part of it),
`prepare_request` resolves `previous_response_id` (the re-rendered conversation starts with the
same tokens as before, so the KV prefix cache serves them) and renders the prompt; any problem
raises an `APIError` before a byte is sent. `ResponseJob.run` drives the assembler and writes
events to an `EventLog` that any number of readers follow (the SSE writer, a WebSocket, a
resumed background stream).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from expresslane.engine.output import RequestOutput
from expresslane.engine.protocol import PreparedRequest
from expresslane.server.admission import Admission, Built, Endpoint, admit_and_submit
from expresslane.server.durability import ProgressClock, mark_interrupted
from expresslane.server.errors import database_unavailable, invalid
from expresslane.server.event_log import EventLog
from expresslane.server.generation import Generation, make_params
from expresslane.server.keys import ApiKey
from expresslane.server.limits import off_loop, text_size
from expresslane.server.prompt import (
    new_id,
    render,
    responses_input,
    template_tools,
)
from expresslane.server.reasoning import requested_effort
from expresslane.server.response_builder import ResponseAssembler, base_response, usage
from expresslane.server.response_tools import Offered, echoed_tools, responses_tool_setup
from expresslane.server.schemas import ResponseCreateRequest
from expresslane.server.state import ServerState
from expresslane.server.store import Origin
from expresslane.server.tool_parsers import ToolParser
from expresslane.server.truncation import fit

SEALED = "reasoning.encrypted_content"  # the `include` that seals reasoning (sealing.py)
log = logging.getLogger("expresslane.server")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponseJob:
    """A running response. Stored ones (`store`) are written when they start, as they progress
    (see `durability.ProgressClock`) and when they end; `owner` may read them."""

    def __init__(
        self,
        state: ServerState,
        response: dict,
        items: list[dict],
        context: list[dict],
        new_messages: list[dict],
        generation: Generation,
        assembler: ResponseAssembler,
        log_: EventLog,
        store: bool,
    ):
        self.state = state
        self.id = response["id"]
        self.response = response
        self.items = items
        self.context = context
        self.new_messages = new_messages
        self.gen = generation
        self.assembler = assembler
        self.log = log_
        self.store = store
        self.task: asyncio.Task | None = None
        self.full_context: list[dict] | None = None  # set when the response completes
        self.warmup = False  # WebSocket `generate: false`: prefill only, no output
        self.interrupted: tuple[str, str] | None = None  # (reason, message): server stopped it
        self._progress = ProgressClock()

    @property
    def background(self) -> bool:
        return self.response["background"]

    @property
    def owner(self) -> str:
        return self.gen.ticket.owner

    def origin(self) -> Origin:
        t = self.gen.ticket
        return Origin(
            t.owner, t.key.id, t.tier_requested, t.lane, self.state.model_name, self.gen.request_id
        )

    async def start(self, announced: bool = True) -> asyncio.Task:
        """`announced`: the client gets the id before the end (background, streams). Such a
        stored response is committed before it runs, so neither the create's answer nor a
        stream's first event can hand out an id that a crash would lose; for the others the
        end's commit, awaited before the answer, is what makes the id durable."""
        if self.store:
            try:
                batch = self.state.store.put(self.response, self.items, [], self.origin())
                if announced:
                    await self.state.store.committed(batch)
            except Exception as e:
                log.exception("could not store response %s", self.id)
                self.gen.abort()
                raise database_unavailable() from e
        self.state.jobs[self.id] = self
        self.task = asyncio.get_running_loop().create_task(self.run())
        return self.task

    async def run(self) -> None:
        final = None
        try:
            self.assembler.start()
            async for out in self.gen:
                if out.finished:
                    final = out
                if not self.warmup:
                    self.assembler.add(out)
                    saving = self.store and not out.finished
                    if saving and self._progress.due(out.num_output_tokens):
                        self._save_progress(out)
            self._finish(final)
        except asyncio.CancelledError:
            if self.interrupted is None:
                self.gen.abort()
                self.assembler.cancelled(self.gen.spent, self.gen.request.num_prompt_tokens)
                raise
            self._stop_interrupted()
        except Exception:
            log.exception("response %s failed", self.id)
            self.assembler.finish(final, "internal server error")
        finally:
            await self._persist()  # the end is durable before the stream ends
            self.log.close()
            self._forget()

    def _finish(self, final: RequestOutput | None) -> None:
        error = None
        if final is not None and final.finish_reason in ("error", "abort"):
            error = final.error or f"generation ended early ({final.finish_reason})"
        if self.warmup and error is None:
            self.assembler.finish_empty(final)
            self.full_context = self.context + self.new_messages
        else:
            self.assembler.finish(final, error)
        if error is None and not self.warmup:
            self.full_context = self._conversation(self.assembler.calls)

    def _conversation(self, calls: list) -> list[dict]:
        return self.context + self.new_messages + self.assembler.turn(calls)

    def _stop_interrupted(self) -> None:
        """The server stopped it: incomplete, with its output so far, billed as interrupted."""
        self.gen.abort("interrupted")
        spent = usage(self.gen.spent)
        if self.gen.spent is None:
            spent["input_tokens"] = spent["total_tokens"] = self.gen.request.num_prompt_tokens
        mark_interrupted(self.response, self.interrupted, spent)
        self.full_context = self._conversation([])
        self.log.emit({"type": "response.incomplete", "response": self.response})

    def _save_progress(self, out: RequestOutput) -> None:
        self._save({**self.response, "usage": usage(out)}, self._conversation([]))

    def _save(self, response: dict, context: list[dict]) -> int | None:
        try:
            return self.state.store.put(response, self.items, context, self.origin())
        except Exception:  # the client's answer matters more than its stored copy
            log.exception("could not store response %s", self.id)
            return None

    async def _persist(self) -> None:
        if not self.store:
            return
        try:
            if self.response["status"] == "cancelled" and not self.background:
                batch = self.state.store.delete(self.id)  # a stream its client left
            else:
                batch = self._save(self.response, self.full_context or [])
            if batch is not None:
                await self.state.store.committed(batch)
        except Exception:
            log.exception("could not store the end of response %s", self.id)

    def _forget(self) -> None:
        if not self.background:
            self.state.jobs.pop(self.id, None)
            return
        settings = self.state.settings
        asyncio.get_running_loop().call_later(
            settings.background_retention_seconds, self.state.jobs.pop, self.id, None
        )
        jobs = self.state.jobs.items()
        finished = [rid for rid, job in jobs if job.task is not None and job.task.done()]
        for rid in finished[: max(0, len(finished) - settings.background_retention_count)]:
            self.state.jobs.pop(rid, None)  # the oldest first: their events stay in the store

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def interrupt(self, why: tuple[str, str]) -> None:
        """Stop it because the server stops: it ends incomplete (see `durability`)."""
        if self.task is not None and not self.task.done():
            self.interrupted = why
            self.task.cancel()

    async def wait(self) -> None:
        if self.task is not None:
            await asyncio.wait({self.task})


def resolve_previous(
    state: ServerState,
    rid: str | None,
    local: dict[str, list[dict]] | None = None,
    *,
    owner: str,
) -> list[dict]:
    """The conversation a previous_response_id ends, from the connection cache or the store
    (only `owner`'s responses: another's answers as if it did not exist)."""
    if rid is None:
        return []
    if local is not None and rid in local:
        return local[rid]
    stored = state.store.get(rid, owner)
    if stored is None or stored.response["status"] not in ("completed", "incomplete"):
        why = "was not found" if stored is None else f"is {stored.response['status']}"
        raise invalid(
            f"Previous response with id '{rid}' {why}; it must be a finished "
            "response created with store=true (or, over a WebSocket, the latest "
            "response on the connection). Send the full conversation instead.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return stored.context


def _with_logprobs(req: ResponseCreateRequest) -> bool:
    return req.top_logprobs is not None or LOGPROBS_INCLUDE in (req.include or ())


@dataclass
class Prepared:
    """A validated Responses request, rendered and tokenized, not yet submitted."""

    engine_req: PreparedRequest
    items: list[dict]
    context: list[dict]
    new_messages: list[dict]
    tools: list[dict]  # as the request sent them (the response echoes them)
    choice: Any
    parser: ToolParser | None
    declared: set[str]
    offered: Offered


def check(state: ServerState, req: ResponseCreateRequest) -> int:
    """The Responses API's checks before any work; the input's characters (the model is
    admission's to check)."""
    if req.background and req.store is False:
        raise invalid("background mode needs store=true.", param="background")
    raw_input = _input(req)
    return state.check_size(
        items=len(raw_input) if isinstance(raw_input, list) else 1,
        tools=len(req.tools or []),
        text=[raw_input, req.instructions],
        param="input",
        truncate=req.truncation == "auto",
    )


def _input(req: ResponseCreateRequest) -> object:
    """The request's input: a string or items."""
    return req.input if req.input is not None else []


async def prepare_request(
    admission: Admission,
    req: ResponseCreateRequest,
    *,
    local: dict[str, list[dict]] | None = None,
    generate: bool = True,
) -> Prepared:
    """Resolve previous_response_id, render (truncation=auto: `truncation.py`) and make the
    engine request (`check` ran before); starts nothing, so POST /v1/responses/input_tokens
    counts with it."""
    state = admission.state
    context = resolve_previous(state, req.previous_response_id, local, owner=admission.ticket.owner)
    owner = admission.ticket.owner

    def unseal(token: str, param: str) -> str:
        return state.sealer.open(owner, token, param)

    items, new_messages = responses_input(_input(req), context, unseal=unseal)
    setup, choice, tools_offered = responses_tool_setup(state, req)
    tools, parser = setup.tools, setup.parser
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    params = _sampling(req, setup, generate)
    rid = new_id("resp")
    template = template_tools(tools) if parser else None
    effort = requested_effort(req.reasoning)

    def attempt(messages: list[dict]) -> PreparedRequest:
        prompt = render(state.tokenizer, messages, template, effort=effort)
        return admission.make(prompt, params, rid, add_special_tokens=False)

    def render_and_make() -> PreparedRequest:
        messages = system + context + new_messages
        if req.truncation == "auto":
            return fit(messages, attempt, state.max_prompt_chars)
        return attempt(messages)

    engine_req = await off_loop(render_and_make, admission.chars + text_size(context))
    return Prepared(
        engine_req,
        items,
        context,
        new_messages,
        echoed_tools(req),
        choice,
        parser,
        setup.declared,
        tools_offered,
    )


def _sampling(req: ResponseCreateRequest, setup, generate: bool):
    skip_special = req.skip_special_tokens
    if skip_special is None and setup.keep_special_tokens:
        skip_special = False  # the markers must stay in the text to be parsed
    return make_params(
        "responses",
        req,
        max_tokens=req.max_output_tokens if generate else 1,
        seed=req.seed,
        logprobs=(req.top_logprobs or 0) if _with_logprobs(req) else None,
        skip_special_tokens=skip_special,
        grammar=setup.grammar,
    )


async def create_job(
    state: ServerState,
    req: ResponseCreateRequest,
    *,
    key: ApiKey,
    received: float,
    http: Any = None,
    local: dict[str, list[dict]] | None = None,
    extra: dict | None = None,
    generate: bool = True,
) -> ResponseJob:
    """Admit and submit the request (`admission.py`), and the job that runs it; `http` is
    the HTTP request, None over a WebSocket."""

    async def build(admission: Admission, body: ResponseCreateRequest) -> Built:
        p = await prepare_request(admission, body, local=local, generate=generate)
        return Built([p.engine_req], 1, p)

    endpoint = Endpoint(lambda body: "responses", check, build)
    admitted = await admit_and_submit(state, req, endpoint, key=key, received=received, http=http)
    req, p, (gen,) = admitted.body, admitted.built.extra, admitted.gens
    store = req.store is not False
    response = base_response(
        p.engine_req.request_id,
        req,
        model=admitted.model,
        tier=admitted.ticket.lane,
        tools=p.tools,
        tool_choice=p.choice,
        store=store,
    )
    if p.offered.not_offered:
        response["tools_not_offered"] = p.offered.not_offered
    event_log = EventLog(extra)
    streamer = p.parser.streamer(p.declared) if p.parser is not None else None
    assembler = ResponseAssembler(
        response,
        event_log.emit,
        state.tokenizer,
        streamer,
        _with_logprobs(req),
        req.max_tool_calls,
        state.reasoning_parser.streamer(),
        p.offered.call_item,
        state.sealer.sealing(admitted.ticket.owner) if SEALED in (req.include or ()) else None,
    )
    job = ResponseJob(
        state, response, p.items, p.context, p.new_messages, gen, assembler, event_log, store
    )
    job.warmup = not generate
    return job
