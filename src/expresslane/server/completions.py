"""POST /v1/completions: a string, strings, token ids or lists of token ids; plain or streamed;
`n` choices per prompt (index = prompt * n + choice), `echo`, `logprobs` (top-N; with `echo`
the prompt tokens' too, the first one's null as in OpenAI's)."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from expresslane.server.admission import Admission, Built, Endpoint, admit_and_submit
from expresslane.server.body import StrictJSONRoute
from expresslane.server.errors import APIError, generation_error, invalid
from expresslane.server.generation import (
    abort_all,
    collect,
    make_params,
    merged,
    openai_penalties,
)
from expresslane.server.logprobs import completion_logprobs
from expresslane.server.schemas import CompletionRequest, check_unsupported
from expresslane.server.sse import DONE, ChunkEvents, EventStream, event
from expresslane.server.state import ServerState, get_state

router = APIRouter(route_class=StrictJSONRoute)


def _prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("'prompt' must not be empty.", param="prompt", code="empty_input")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def _check_prompts(state: ServerState, prompts: list[str | list[int]]) -> int:
    """Size limits and token-id ranges, before any work; returns the characters of text."""
    chars = state.check_size(items=len(prompts), tools=0, text=prompts, param="prompt")
    vocab = state.vocab_size
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            continue
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if state.max_model_len is not None and len(p) > state.max_model_len:
            raise APIError(
                400,
                f"'{param}' has {len(p)} tokens but this model's context is "
                f"{state.max_model_len} tokens (prompt plus output); shorten it.",
                param=param,
                code="context_length_exceeded",
            )
        if vocab is not None and any(not 0 <= t < vocab for t in p):
            raise invalid(f"token ids in '{param}' must be in [0, {vocab}).", param=param)
    return chars


class _Choice:
    def __init__(self, index: int, echo: str, logprobs: bool, prompt_ids: list[int] | None):
        self.index = index
        self.text = echo
        self.logprobs = (
            {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            if logprobs
            else None
        )
        # echo with logprobs: the echo is sent with its tokens' logprobs, in the first output
        self.prompt_ids = prompt_ids
        self.final = None

    def add(self, tokenizer, out) -> tuple[str, dict | None]:
        head, lp = "", None
        if self.prompt_ids is not None and out.prompt_logprobs is not None:
            lp = completion_logprobs(tokenizer, self.prompt_ids, out.prompt_logprobs, 0)
            head, self.prompt_ids = self.text, None
        if self.logprobs is not None and out.new_logprobs:
            new = completion_logprobs(
                tokenizer, out.new_token_ids, out.new_logprobs, len(self.text)
            )
            lp = new if lp is None else {key: lp[key] + new[key] for key in lp}
        if lp is not None:
            for key, values in lp.items():
                self.logprobs[key] += values
        self.text += out.new_text
        if out.finished:
            self.final = out
            if out.finish_reason in ("error", "abort"):
                raise generation_error(out.error)
        return head + out.new_text, lp

    def body(self) -> dict:
        return {
            "index": self.index,
            "text": self.text,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
        }

    @property
    def finish_reason(self) -> str:
        return "length" if self.final and self.final.finish_reason == "length" else "stop"


def _prompt_ids(gen) -> list[int]:
    return gen.request.prompt_token_ids


def _usage(choices: list[_Choice], n: int) -> dict:
    firsts = [c.final for c in choices[::n] if c.final]  # one per prompt
    n_in = sum(f.num_prompt_tokens for f in firsts)
    n_out = sum(c.final.num_output_tokens for c in choices if c.final)
    cached = sum(f.num_cached_tokens for f in firsts)
    return {
        "prompt_tokens": n_in,
        "completion_tokens": n_out,
        "total_tokens": n_in + n_out,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _check_unsupported(body: CompletionRequest) -> int:
    """The number of choices per prompt, or a 400 for what this server does not do."""
    check_unsupported(body)
    if body.suffix:
        raise invalid("'suffix' is not supported.", param="suffix", code="unsupported_parameter")
    n = body.n or 1
    if body.best_of is not None and body.best_of != n:
        raise invalid(
            "'best_of' other than 'n' is not supported.",
            param="best_of",
            code="unsupported_parameter",
        )
    return n


def _choices_of(body: CompletionRequest, prompts: list, n: int, tok):
    """(prompt, sampling params, echo text) of every choice: each prompt n times."""
    all_prompts, params, echoes = [], [], []
    for p in prompts:
        echo = ""
        if body.echo:
            echo = p if isinstance(p, str) else (tok.decode(p) if tok is not None else "")
        for j in range(n):
            all_prompts.append(p)
            echoes.append(echo)
            params.append(
                make_params(
                    "completions",
                    body,
                    max_tokens=body.max_tokens,
                    seed=None if body.seed is None else body.seed + j,
                    logprobs=body.logprobs,
                    prompt_logprobs=body.logprobs if body.echo else None,
                    skip_special_tokens=body.skip_special_tokens,
                    **openai_penalties(body),
                )
            )
    return all_prompts, params, echoes


def _check(state: ServerState, body: CompletionRequest) -> int:
    """Checks before any work; the prompts' characters."""
    _check_unsupported(body)
    return _check_prompts(state, _prompts(body.prompt))


async def _build(admission: Admission, body: CompletionRequest) -> Built:
    """Every prompt n times, one request per choice; keeps (id, echoes)."""
    n = body.n or 1
    prompts = _prompts(body.prompt)
    all_prompts, params, echoes = _choices_of(body, prompts, n, admission.state.tokenizer)
    cid = "cmpl-" + uuid.uuid4().hex
    reqs = await admission.make_all(all_prompts, params, cid, chars=admission.chars * n)
    return Built(reqs, n, (cid, echoes))


def _generations(body: CompletionRequest) -> int:
    """Choices times prompts (`_check` has run: the prompt is valid)."""
    return (body.n or 1) * len(_prompts(body.prompt))


COMPLETIONS = Endpoint(lambda body: "completions", _check, _build, _generations)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    received = time.perf_counter()
    state: ServerState = get_state(request)
    key = request.state.api_key  # set by AuthMiddleware
    admitted = await admit_and_submit(
        state, body, COMPLETIONS, key=key, received=received, http=request
    )
    body, gens, n = admitted.body, admitted.gens, admitted.built.n
    cid, echoes = admitted.built.extra
    tok = state.tokenizer
    with_logprobs = body.logprobs is not None
    echo_logprobs = body.echo and with_logprobs
    choices = [
        _Choice(i, echoes[i], with_logprobs, _prompt_ids(g) if echo_logprobs else None)
        for i, g in enumerate(gens)
    ]
    base = {
        "id": cid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": admitted.model,
        "system_fingerprint": None,
        "service_tier": admitted.ticket.lane,  # not in OpenAI's legacy schema; echoed as in Chat
    }

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(
            _stream(state, gens, choices, base, n, include_usage), on_close=lambda: abort_all(gens)
        )

    if not await collect(request, gens, lambda i, out: choices[i].add(tok, out)):
        return Response(status_code=499)
    return JSONResponse(
        {**base, "choices": [c.body() for c in choices], "usage": _usage(choices, n)}
    )


async def _stream(state, gens, choices, base, n: int, include_usage: bool):
    events = ChunkEvents(base, include_usage)

    def chunk(i: int, text: str, lp=None, finish=None) -> str:
        return events.event({"index": i, "text": text, "logprobs": lp, "finish_reason": finish})

    for c in choices:
        if c.text and c.prompt_ids is None:  # echo (with logprobs: in the first output)
            yield chunk(c.index, c.text)
    try:
        async for i, out in merged(gens):
            text, lp = choices[i].add(state.tokenizer, out)
            finish = choices[i].finish_reason if out.finished else None
            if text or lp or finish:
                yield chunk(i, text, lp, finish)
    except APIError as e:
        yield event(None, e.body())
        yield DONE
        return
    if include_usage:
        yield event(None, {**base, "choices": [], "usage": _usage(choices, n)})
    yield DONE
