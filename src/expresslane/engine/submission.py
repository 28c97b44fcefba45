"""`Submission`: everything a caller says about one request it hands the engine, typed.

It is the one way into an engine (`ServingEngine.make_request`, `RequestFactory.make`): the
server builds one per prompt (server/admission.py), a fleet's ingress sends its fields to a
replica, which builds it again."""

from __future__ import annotations

from dataclasses import dataclass

from expresslane.sampling_params import SamplingParams


@dataclass(frozen=True)
class Submission:
    """A request before validation. `prompt` is text (tokenized with `add_special_tokens`)
    or token ids; `lane` the engine lane that serves it (the API's service tier, resolved by
    `lanes.lane_for`); requests share cached prompt prefixes only with requests of the same
    `cache_salt` (None: with every request without one; the server folds the owner in);
    `tenant` names whose it is (an API key's id), for the lane shares of the scheduler;
    `clamp_max_tokens` lowers a `max_tokens` past the context to what fits (else an error)."""

    prompt: str | list[int]
    params: SamplingParams
    request_id: str | None = None
    lane: str = "default"
    add_special_tokens: bool = True
    cache_salt: str | None = None
    tenant: str | None = None
    clamp_max_tokens: bool = False
