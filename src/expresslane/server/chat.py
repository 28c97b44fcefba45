"""POST /v1/chat/completions: plain and streamed, tools -> tool_calls, logprobs, n choices,
`stream_options.include_usage` (a final chunk with `choices: []` and the usage)."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from expresslane.server.admission import Admission, Built, Endpoint, admit_and_submit
from expresslane.server.body import StrictJSONRoute
from expresslane.server.chat_choice import Choice, chat_usage, check_finished
from expresslane.server.errors import APIError, invalid
from expresslane.server.generation import (
    abort_all,
    collect,
    make_params,
    merged,
    openai_penalties,
)
from expresslane.server.limits import off_loop
from expresslane.server.prompt import chat_messages, render, template_tools
from expresslane.server.reasoning import Split
from expresslane.server.schemas import ChatCompletionRequest, check_unsupported
from expresslane.server.sse import DONE, ChunkEvents, EventStream, event
from expresslane.server.state import ServerState, get_state
from expresslane.server.tool_choice import ToolSetup, output_schema, tool_setup

router = APIRouter(route_class=StrictJSONRoute)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    received = time.perf_counter()
    state: ServerState = get_state(request)
    key = request.state.api_key  # set by AuthMiddleware
    admitted = await admit_and_submit(state, body, CHAT, key=key, received=received, http=request)
    body, gens, (cid, setup) = admitted.body, admitted.gens, admitted.built.extra
    choices = [
        Choice(
            i,
            setup.parser,
            setup.declared,
            state.tokenizer,
            bool(body.logprobs),
            body.parallel_tool_calls is not False,
            state.reasoning_parser,
        )
        for i in range(len(gens))
    ]
    base = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": admitted.model,
        "system_fingerprint": None,
        "service_tier": admitted.ticket.lane,
    }
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(
            _stream(gens, choices, base, include_usage), on_close=lambda: abort_all(gens)
        )
    return await _plain(request, gens, choices, base)


def _validate(state: ServerState, body: ChatCompletionRequest) -> int:
    """Checks before any work; the prompt's characters."""
    check_unsupported(body)
    chars = state.check_size(
        items=len(body.messages), tools=len(body.tools or []), text=body.messages, param="messages"
    )
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    return chars


def _api(body: ChatCompletionRequest) -> str:
    """Errors name max_tokens as the client sent it (`errors.API_FIELDS`)."""
    return "chat" if body.max_tokens is None else "chat_max_tokens"


async def _build(admission: Admission, body: ChatCompletionRequest) -> Built:
    """Render the prompt, one request per choice; keeps (id, tool setup)."""
    state = admission.state
    messages = chat_messages(body.messages)
    tools = [
        {
            "name": t.function.name,
            "description": t.function.description,
            "parameters": t.function.parameters,
        }
        for t in body.tools or []
    ]
    setup = _setup(state, body, tools)
    template = template_tools(tools) if setup.parser else None
    prompt = await off_loop(
        lambda: render(state.tokenizer, messages, template, "messages", body.reasoning_effort),
        admission.chars,
    )
    skip = body.skip_special_tokens
    if skip is None and setup.keep_special_tokens:
        skip = False
    params = [
        make_params(
            admission.api,
            body,
            max_tokens=body.max_completion_tokens or body.max_tokens,
            seed=None if body.seed is None else body.seed + i,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            skip_special_tokens=skip,
            **openai_penalties(body),
            grammar=setup.grammar,
        )
        for i in range(body.n or 1)
    ]
    cid = "chatcmpl-" + uuid.uuid4().hex
    reqs = await admission.make_all([prompt] * len(params), params, cid, add_special_tokens=False)
    return Built(reqs, len(params), (cid, setup))


CHAT = Endpoint(_api, _validate, _build, lambda body: body.n or 1)


async def _plain(request: Request, gens, choices: list[Choice], base: dict) -> Response:
    """The whole completion as one JSON body (499 if the client left first)."""

    def add(i: int, out) -> None:
        check_finished(out)
        choices[i].add(out)

    if not await collect(request, gens, add):
        return Response(status_code=499)
    result = {**base, "object": "chat.completion", "choices": [], "usage": None}
    for c in choices:
        c.finish()
        message = {
            "role": "assistant",
            "content": c.text if c.text or not c.calls else None,
            **({"reasoning_content": c.reasoning} if c.reasoning else {}),
            "refusal": None,
            "annotations": [],
        }
        if c.calls:
            message["tool_calls"] = c.tool_calls()
        result["choices"].append(
            {
                "index": c.index,
                "message": message,
                "logprobs": {"content": c.logprobs, "refusal": None} if c.want_logprobs else None,
                "finish_reason": c.finish_reason,
            }
        )
    result["usage"] = chat_usage(choices)
    return JSONResponse(result)


def _setup(state: ServerState, body: ChatCompletionRequest, tools: list[dict]) -> ToolSetup:
    choice, forced = body.tool_choice, None
    if choice is not None and not isinstance(choice, str):
        choice, forced = None, choice.function.name
    fmt = body.response_format
    spec = fmt.json_schema if fmt is not None else None
    content = output_schema(
        fmt.type if fmt else None, spec.schema_ if spec else None, "response_format.json_schema"
    )
    return tool_setup(
        state,
        tools,
        choice,
        forced,
        parallel=body.parallel_tool_calls is not False,
        content=content,
        param="tool_choice.function.name",
        content_param="response_format",
    )


async def _stream(gens, choices: list[Choice], base: dict, include_usage: bool):
    events = ChunkEvents(base, include_usage)

    def chunk(index: int, delta: dict, finish=None, logprobs=None) -> str:
        c = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return events.event(c)

    for c in choices:
        yield chunk(c.index, {"role": "assistant", "content": ""})
    try:
        async for i, out in merged(gens):
            check_finished(out)
            c = choices[i]
            for delta in _deltas(c.add(out)):
                yield chunk(i, delta, logprobs=c.take_logprobs())
            if not out.finished:
                continue
            for delta in _deltas(c.finish()):
                yield chunk(i, delta, logprobs=c.take_logprobs())
            for k, call in enumerate(c.calls):
                yield chunk(
                    i,
                    {
                        "tool_calls": [
                            {
                                "index": k,
                                "id": call.id,
                                "type": "function",
                                "function": {"name": call.name, "arguments": ""},
                            }
                        ]
                    },
                )
                yield chunk(
                    i, {"tool_calls": [{"index": k, "function": {"arguments": call.arguments}}]}
                )
            yield chunk(
                i, {}, finish=c.finish_reason, logprobs=c.take_logprobs() if c.pending else None
            )
    except APIError as e:
        yield event(None, e.body())
        yield DONE
        return
    if include_usage:
        yield event(None, {**base, "choices": [], "usage": chat_usage(choices)})
    yield DONE


def _deltas(split: Split) -> list[dict]:
    """A choice's new reasoning and text as chunk deltas (vLLM's `reasoning_content`)."""
    out = [{"reasoning_content": split.reasoning}] if split.reasoning else []
    return out + ([{"content": split.content}] if split.content else [])
