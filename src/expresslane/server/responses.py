"""The Responses API over HTTP: create (JSON, SSE, background), retrieve (and resume a
background stream), delete, cancel, list input items, count input tokens. WebSocket mode is in
`websocket.py`."""

from __future__ import annotations

import copy
import time
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from expresslane.server.accounts import Ticket
from expresslane.server.admission import Admission
from expresslane.server.body import StrictJSONRoute
from expresslane.server.errors import APIError, generation_error, invalid, not_found
from expresslane.server.response_job import ResponseJob, check, create_job, prepare_request
from expresslane.server.schemas import InputTokensRequest, ResponseCreateRequest
from expresslane.server.sse import EventStream, event, until_disconnected
from expresslane.server.state import ServerState, get_state

router = APIRouter(route_class=StrictJSONRoute)


async def _sse(job: ResponseJob, after: int = -1):
    """The job's events as SSE; as in OpenAI's Responses API, no `[DONE]` after the last."""
    async for name, data in job.log.follow(after):
        yield event(name, data)


@router.post("/v1/responses")
async def create_response(body: ResponseCreateRequest, request: Request):
    received = time.perf_counter()
    key = request.state.api_key  # set by AuthMiddleware
    job = await create_job(get_state(request), body, key=key, received=received, http=request)
    snapshot = copy.deepcopy(job.response)
    await job.start(announced=bool(body.background or body.stream))
    if body.background:
        if body.stream:
            return EventStream(_sse(job))  # the job outlives this connection
        return JSONResponse(snapshot)
    if body.stream:
        return EventStream(_sse(job), on_close=job.cancel)
    if not await until_disconnected(request, job.task):
        return Response(status_code=499)
    if job.response["status"] == "failed":
        raise generation_error(job.response["error"]["message"])
    return JSONResponse(job.response)


class InputTokens(BaseModel):
    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


@router.post("/v1/responses/input_tokens", response_model=InputTokens)
async def count_input_tokens(body: InputTokensRequest, request: Request):
    """The prompt tokens the same create would use, truncation included; nothing runs."""
    if body.conversation is not None:
        raise invalid(
            "Conversations are not supported by this server; send the items, or use "
            "previous_response_id.",
            param="conversation",
            code="unsupported_parameter",
        )
    key = request.state.api_key  # set by AuthMiddleware
    ticket = Ticket(key, key.plan.default_tier, key.plan.default_tier)  # no lane is used
    state = get_state(request)
    state.check_model(body.model)
    admission = Admission(state, ticket, "responses", body.cache_salt, check(state, body))
    prepared = await prepare_request(admission, body)
    return InputTokens(input_tokens=prepared.engine_req.num_prompt_tokens)


def _owner(request: Request) -> str:
    return request.state.api_key.owner  # set by AuthMiddleware


def _not_found(response_id: str) -> APIError:
    return not_found(
        f"No response with id '{response_id}' found; only responses created "
        "with store=true are kept.",
        param="response_id",
        code="response_not_found",
    )


def _job(state: ServerState, request: Request, response_id: str) -> ResponseJob | None:
    """The caller's job in memory with this id (another owner's is as good as none)."""
    job = state.jobs.get(response_id)
    return job if job is not None and job.owner == _owner(request) else None


def _lookup(
    state: ServerState, request: Request, response_id: str
) -> tuple[ResponseJob | None, dict, list[dict]]:
    """(job in memory or None, response, input items) of the caller's response; 404 if there
    is none or it is another owner's (the same answer: ids of others cannot be probed)."""
    job = _job(state, request, response_id)
    if job is not None:
        return job, job.response, job.items
    stored = state.store.get(response_id, _owner(request))
    if stored is None:
        raise _not_found(response_id)
    return None, stored.response, stored.input_items


@router.get("/v1/responses/{response_id}")
async def retrieve_response(
    response_id: str,
    request: Request,
    stream: bool = False,
    starting_after: int | None = None,
    include: list[str] | None = Query(None, alias="include[]"),
):
    state = get_state(request)
    job, response, _ = _lookup(state, request, response_id)
    if not stream:
        return JSONResponse(response)
    if job is None:
        raise invalid(
            "This response's events are no longer available to stream; retrieve it "
            "without stream=true.",
            param="stream",
        )
    return EventStream(_sse(job, -1 if starting_after is None else starting_after))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    state = get_state(request)
    job = _job(state, request, response_id)
    if job is not None:
        job.cancel()
        await job.wait()
        state.jobs.pop(response_id, None)
    batch = state.store.delete(response_id, _owner(request))
    if batch is None and job is None:
        raise _not_found(response_id)
    if batch is not None:
        await state.store.committed(batch)
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request):
    state = get_state(request)
    job, response, _ = _lookup(state, request, response_id)
    if not response.get("background"):
        raise invalid(
            "Only responses created with background=true can be cancelled.",
            param="response_id",
            code="not_background",
        )
    if job is not None:
        job.cancel()
        await job.wait()
        response = job.response
    return JSONResponse(response)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    request: Request,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
    include: list[str] | None = Query(None, alias="include[]"),
):
    _, _, items = _lookup(get_state(request), request, response_id)
    items = list(reversed(items)) if order == "desc" else list(items)
    if after is not None:
        ids = [it.get("id") for it in items]
        if after not in ids:
            raise invalid(f"No input item with id '{after}' in this response.", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }
