"""What the engine hands back per request per step, and the stop checks that decide it:
EOS and stop ids, max_tokens, max_model_len, and stop strings on the detokenized text (the
text that could still grow into a stop string is held back until it cannot)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from expresslane.engine.request import Request, RequestMetrics, Status
from expresslane.tokenizer import Tokenizer


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", "error"
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    metrics: RequestMetrics
    stop_reason: str | int | None = None
    new_logprobs: list[dict] = field(default_factory=list)
    error: str | None = None
    # with SamplingParams.prompt_logprobs: one entry per prompt token (None for the first),
    # complete from the first output that has tokens
    prompt_logprobs: list[dict | None] | None = None


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one (a consumer that fell behind forwards what
    piled up in one piece)."""
    if len(outputs) == 1:
        return outputs[0]
    return dataclasses.replace(
        outputs[-1],
        new_token_ids=[t for o in outputs for t in o.new_token_ids],
        new_text="".join(o.new_text for o in outputs),
        new_logprobs=[lp for o in outputs for lp in o.new_logprobs],
        prompt_logprobs=next(
            (o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None
        ),
    )


class TextState:
    """Per-request detokenization and stop-string search."""

    __slots__ = ("stream", "text", "emitted", "holdback")

    def __init__(self, tokenizer: Tokenizer, req: Request):
        self.stream = tokenizer.stream(
            req.token_ids[: req.num_prompt_tokens], req.params.skip_special_tokens
        )
        self.text = ""
        self.emitted = 0
        self.holdback = max((len(s) for s in req.params.stop), default=1) - 1


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def append_token(self, req: Request, token: int, logprob: dict | None) -> None:
        """Record one sampled token and finish the request if a stop condition holds."""
        req.metrics.token_at(time.perf_counter())
        req.token_ids.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        if token in req.stop_ids and req.num_output_tokens > req.params.min_tokens - 1:
            self.finish(
                req, "stop", stop_reason=token if token in req.params.stop_token_ids else None
            )
        elif req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            self.finish(req, "length")
        if self.tokenizer is not None:
            self._detokenize(req, token)

    def _detokenize(self, req: Request, token: int) -> None:
        state: TextState = req.detok
        if req.finish_reason == "stop" and req.stop_reason is None:
            return  # EOS text is never shown
        prev = len(state.text)
        state.text += self.tokenizer.step(state.stream, token)
        if not req.params.stop or req.is_finished:
            return
        window_start = max(0, prev - state.holdback)
        for stop in req.params.stop:
            idx = state.text.find(stop, window_start)
            if idx != -1:
                state.text = state.text[:idx]
                self.finish(req, "stop", stop_reason=stop)
                return

    def finish(self, req: Request, reason: str, stop_reason=None) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.metrics.finished = time.perf_counter()

    def make_output(
        self, req: Request, num_new_tokens: int, error: str | None = None
    ) -> RequestOutput:
        new_ids = req.token_ids[req.num_tokens - num_new_tokens :] if num_new_tokens else []
        new_text = ""
        state: TextState | None = req.detok
        if state is not None:
            end = (
                len(state.text)
                if req.is_finished
                else max(state.emitted, len(state.text) - state.holdback)
            )
            new_text = state.text[state.emitted : end]
            state.emitted = end
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=req.num_output_tokens,
            metrics=req.metrics,
            stop_reason=req.stop_reason,
            new_logprobs=req.logprobs[len(req.logprobs) - num_new_tokens :]
            if req.logprobs and num_new_tokens
            else [],
            error=error,
            prompt_logprobs=req.prompt_logprobs,
        )
