"""Admission: one path from a request body to running generations, shared by every endpoint
(Chat Completions, Completions, and Responses over HTTP and over a WebSocket), in one order:

1. the model is checked (404, `ServerState.check_model`);
2. the model's generation-config defaults fill the sampling fields the body leaves unset;
3. the endpoint's own checks run (sizes, field combinations), before any work;
4. the key is admitted to a lane for the request's generations (`accounts.py`: entitlement,
   queue bounds and requests/min, reserved until they end or the request fails);
5. the endpoint renders its prompts and makes each engine request through `Admission.make`:
   the rules for every request (`check_request`) apply, then the engine validates and
   tokenizes the `Submission` (its errors name the API's fields: `errors.API_FIELDS`);
6. tokens/min is charged for all of them and they start, all or none (`start`).

A rule that applies to every request is written once, in `check_request`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from expresslane.engine.protocol import PreparedRequest
from expresslane.engine.submission import Submission
from expresslane.errors import ExpresslaneError, InvalidRequestError
from expresslane.sampling_params import SamplingParams
from expresslane.server.accounts import Ticket
from expresslane.server.errors import APIError, from_engine_error
from expresslane.server.generation import Generation, abort_all, with_model_defaults
from expresslane.server.keys import LOCAL_OWNER, ApiKey
from expresslane.server.limits import off_loop
from expresslane.server.state import ServerState


@dataclass
class Built:
    """What an endpoint built once admitted: its engine requests (in groups of `n` choices of
    one prompt) and what it keeps to render their outputs (`extra`)."""

    requests: list[PreparedRequest]
    n: int = 1
    extra: Any = None


@dataclass(frozen=True)
class Endpoint:
    """An endpoint's part of admission: `api` names its column of `errors.API_FIELDS` (for
    this body), `check` its own checks before any work (returns the prompt's characters),
    `build` renders and makes its requests with `Admission.make`, `generations` counts them
    (choices times prompts) before any is made."""

    api: Callable[[Any], str]
    check: Callable[[ServerState, Any], int]
    build: Callable[[Admission, Any], Awaitable[Built]]
    generations: Callable[[Any], int] = lambda body: 1


@dataclass
class Admission:
    """An admitted request on its way to the engine: makes its engine requests."""

    state: ServerState
    ticket: Ticket
    api: str
    cache_salt: str | None = None
    chars: int = 0  # the prompt's characters (large ones are rendered off the event loop)

    def make(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        add_special_tokens: bool = True,
    ) -> PreparedRequest:
        """Validate and tokenize one prompt for the ticket's lane; errors name the API's
        fields."""
        try:
            params = check_request(self.state, params)
            sub = Submission(
                prompt,
                params,
                request_id,
                self.ticket.lane,
                add_special_tokens,
                prefix_salt(self.state, self.ticket, self.cache_salt),
                self.ticket.tenant,
                self.state.settings.clamp_max_tokens,
            )
            return self.state.engine.make_request(sub)
        except ExpresslaneError as e:
            raise from_engine_error(e, self.api) from e

    async def make_all(
        self,
        prompts: list,
        params: list[SamplingParams],
        request_id: str,
        add_special_tokens: bool = True,
        chars: int | None = None,
    ) -> list[PreparedRequest]:
        """`make` every prompt (`request_id-i`), off the event loop when they hold more than a
        few thousand characters (`chars`, default the admitted prompt's)."""

        def make_each() -> list[PreparedRequest]:
            return [
                self.make(prompt, p, f"{request_id}-{i}", add_special_tokens)
                for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
            ]

        return await off_loop(make_each, self.chars if chars is None else chars)


@dataclass
class Admitted:
    """A request admitted and started: the model's id, the body with the model's defaults,
    its ticket, its running generations and what its endpoint built."""

    model: str
    body: Any
    ticket: Ticket
    gens: list[Generation]
    built: Built


async def admit_and_submit(
    state: ServerState,
    body: Any,
    endpoint: Endpoint,
    *,
    key: ApiKey,
    received: float,
    http: Any = None,
) -> Admitted:
    """Steps 1-6 above; `http` is the HTTP request (its state gets the ticket, whose
    rate-limit headers go on the response), None over a WebSocket."""
    model = state.check_model(body.model)
    body = with_model_defaults(body, state.engine.sampling_defaults)
    chars = endpoint.check(state, body)
    ticket = state.admit(key, body.service_tier, chars, endpoint.generations(body))
    if http is not None:
        http.state.ticket = ticket
    try:
        admission = Admission(state, ticket, endpoint.api(body), body.cache_salt, chars)
        built = await endpoint.build(admission, body)
        gens = start(state, built.requests, ticket, received, built.n)
    except BaseException:
        state.accounts.release(ticket)  # what was reserved and did not start
        raise
    return Admitted(model, body, ticket, gens, built)


def check_request(state: ServerState, params: SamplingParams) -> SamplingParams:
    """The rules for every request, whichever endpoint it came by; its params as they run.
    `max_output_tokens` (a server setting): no request may ask for more output tokens, and a
    request that sets no limit gets that one."""
    most = state.settings.max_output_tokens
    if most is not None:
        if params.max_tokens is None:
            return dataclasses.replace(params, max_tokens=most)
        if params.max_tokens > most:
            raise InvalidRequestError(
                "{max_tokens} ({asked}) is more than this server's limit of {most} output "
                "tokens per request; lower {max_tokens}",
                param="max_tokens",
                values={"asked": params.max_tokens, "most": most},
            )
    return params


def prefix_salt(state: ServerState, ticket: Ticket, cache_salt: str | None) -> str | None:
    """Whose cached prefixes a request may reuse: with API keys only its owner's (a shared
    prefix cache would let one tenant time another's prompts), unless `share_prefix_cache`
    is set; within that, only requests with the same `cache_salt`. Open local mode shares."""
    owner = ticket.owner
    if owner == LOCAL_OWNER or state.settings.share_prefix_cache:
        owner = None
    parts = [part for part in (owner, cache_salt) if part is not None]
    return "\x00".join(parts) if parts else None


def start(
    state: ServerState, reqs: list[PreparedRequest], ticket: Ticket, received: float, n: int = 1
) -> list[Generation]:
    """Charge tokens/min for all the requests, then submit them all (or none). Requests come
    in groups of `n` choices of the same prompt; a ticket reserved more generations than it
    made gives the others back."""
    estimates = [
        (r.num_prompt_tokens if i % n == 0 else 0) + (r.params.max_tokens or 0)
        for i, r in enumerate(reqs)
    ]
    state.accounts.charge(ticket, sum(estimates))
    gens: list[Generation] = []
    try:
        for i, (req, estimate) in enumerate(zip(reqs, estimates, strict=True)):
            gens.append(Generation(state, req, ticket, estimate, received, i % n == 0))
    except ValueError as e:
        abort_all(gens)
        raise APIError(400, str(e)) from e
    state.accounts.release(ticket, keep=len(gens))
    return gens
