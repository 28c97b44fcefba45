"""Anthropic's Messages API: `POST /v1/messages` (plain and streamed) and
`POST /v1/messages/count_tokens`, on the one admission path (`MESSAGES`, an `Endpoint` of
`admission.py`) with the Chat path's template, tool parsers and grammars.

Fast mode is the ultrafast lane: `speed: "fast"` asks for it (`service_tier` too, for clients
that name a tier), `usage.speed` says what served it, and the key's policy answers when the
lane cannot take the request (429 with `retry-after`, or a downgrade served as `"standard"`).
Errors are in Anthropic's shape (`anthropic_errors.py`), rate limits in its headers
(`messages_headers.py`).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from expresslane.lanes import lane_for
from expresslane.server.admission import Admission, Built, Endpoint, admit_and_submit
from expresslane.server.anthropic_errors import AnthropicRoute
from expresslane.server.chat_choice import Choice
from expresslane.server.errors import invalid
from expresslane.server.generation import abort_all, collect, make_params
from expresslane.server.limits import off_loop
from expresslane.server.messages_headers import RateLimitHeaders
from expresslane.server.messages_output import MessageBuilder, message_id
from expresslane.server.messages_prompt import function_tools, messages_prompt, system_text
from expresslane.server.messages_schema import CountTokensRequest, MessagesJob, MessagesRequest
from expresslane.server.messages_stream import Reply, message_events
from expresslane.server.messages_thinking import effort, shows_thinking, signature_checker
from expresslane.server.sse import EventStream
from expresslane.server.state import ServerState, get_state
from expresslane.server.tool_choice import ToolSetup, tool_setup

router = APIRouter(route_class=AnthropicRoute)
# errors name max_tokens and messages as the Messages API does (`errors.API_FIELDS`)
API = "chat_max_tokens"
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request) -> Response:
    received = time.perf_counter()
    state: ServerState = get_state(request)
    key = request.state.api_key  # set by AuthMiddleware
    job = as_job(body)
    asked = lane_for(job.service_tier, key.plan.default_tier)
    request.state.anthropic_headers = RateLimitHeaders(state.accounts, key, asked)
    admitted = await admit_and_submit(
        state, job, MESSAGES, key=key, received=received, http=request
    )
    ticket, gens = admitted.ticket, admitted.gens
    names = RateLimitHeaders(state.accounts, key, ticket.lane)
    request.state.anthropic_headers = names
    head = {"id": admitted.built.extra[0], "type": "message", "role": "assistant"}
    reply = Reply(
        {**head, "model": admitted.model},
        admitted.built.requests[0].num_prompt_tokens,
        ticket.lane,
        body.stop_sequences,
    )
    builder: MessageBuilder = admitted.built.extra[1]
    if body.stream:
        stream = EventStream(message_events(gens, builder, reply), on_close=lambda: abort_all(gens))
        stream.headers.update(names(ticket.headers))
        return stream
    if not await collect(request, gens, lambda i, out: builder.add(out)):
        return Response(status_code=499)
    return JSONResponse(reply.message(builder), headers=names(ticket.headers))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    """The prompt tokens a create request with these fields would have."""
    state: ServerState = get_state(request)
    state.check_model(body.model)
    chars = _check_size(state, body)
    tokenizer = state.tokenizer
    level = effort(body)
    check = signature_checker(state.sealer, request.state.api_key.owner)

    def count() -> int:
        prompt = messages_prompt(tokenizer, body, level, check)
        return len(tokenizer.encode(prompt, False))

    return {"input_tokens": await off_loop(count, chars)}


def as_job(body: MessagesRequest) -> MessagesJob:
    """The request as admission takes it: `speed` names the lane."""
    tier = body.service_tier
    if body.speed is not None:
        if body.speed == "fast" and tier == "standard_only":
            raise invalid(
                "'speed': 'fast' asks for the fast lane, which 'service_tier': "
                "'standard_only' rules out; send one of them.",
                param="speed",
            )
        tier = "ultrafast" if body.speed == "fast" else "default"
    elif tier == "standard_only":
        tier = "default"
    return MessagesJob(
        request=body,
        model=body.model,
        service_tier=tier,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=body.stop_sequences or None,
    )


def _check_size(state: ServerState, body: CountTokensRequest) -> int:
    text = [system_text(body.system) or "", body.messages]
    return state.check_size(
        items=len(body.messages), tools=len(body.tools or []), text=text, param="messages"
    )


def _validate(state: ServerState, job: MessagesJob) -> int:
    """Checks before any work; the prompt's characters."""
    body = job.request
    thinking = body.thinking
    budget = getattr(thinking, "budget_tokens", None)
    if budget is not None and budget >= body.max_tokens:
        raise invalid(
            "'thinking.budget_tokens' must be less than 'max_tokens'.",
            param="thinking.budget_tokens",
        )
    if any(not s for s in body.stop_sequences or ()):
        raise invalid("'stop_sequences' must not hold empty strings.", param="stop_sequences")
    return _check_size(state, body)


def _setup(state: ServerState, body: MessagesRequest) -> tuple[ToolSetup, bool]:
    """The tool parser and grammar (the Chat path's), and whether calls may be parallel."""
    chosen = body.tool_choice
    choice, forced = None, None
    if chosen is not None:
        if chosen.type == "tool":
            forced = chosen.name
        else:
            choice = _CHOICES[chosen.type]
    parallel = not getattr(chosen, "disable_parallel_tool_use", None)
    fmt = body.output_config.format if body.output_config is not None else None
    setup = tool_setup(
        state,
        function_tools(body),
        choice,
        forced,
        parallel=parallel,
        content=fmt.schema_ if fmt is not None else None,
        param="tool_choice.name",
        content_param="output_config.format",
    )
    return setup, parallel


async def _build(admission: Admission, job: MessagesJob) -> Built:
    """Render the prompt and make its one engine request; keeps (id, its MessageBuilder)."""
    state, body = admission.state, job.request
    setup, parallel = _setup(state, body)
    level = effort(body)
    owner = admission.ticket.owner
    check = signature_checker(state.sealer, owner)
    prompt = await off_loop(
        lambda: messages_prompt(state.tokenizer, body, level, check), admission.chars
    )
    params = make_params(
        admission.api,
        job,
        max_tokens=body.max_tokens,
        skip_special_tokens=False if setup.keep_special_tokens else None,
        grammar=setup.grammar,
    )
    mid = message_id()
    reqs = await admission.make_all([prompt], [params], mid, add_special_tokens=False)
    choice = Choice(
        0,
        setup.parser,
        setup.declared,
        state.tokenizer,
        False,
        parallel,
        state.reasoning_parser,
    )
    sign = state.sealer.signer(owner) if shows_thinking(body) else None
    builder = MessageBuilder(choice, sign)
    return Built(reqs, 1, (mid, builder))


MESSAGES = Endpoint(lambda job: API, _validate, _build)
