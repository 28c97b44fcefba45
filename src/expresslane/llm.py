"""The offline API: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from dataclasses import dataclass, field

from expresslane.config import EngineConfig
from expresslane.engine.engine import LLMEngine
from expresslane.engine.request import Request
from expresslane.engine.submission import Submission
from expresslane.sampling_params import SamplingParams


@dataclass
class Output:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int
    metrics: dict = field(default_factory=dict)  # ttft, queue_time, e2e (s), decode_tokens_per_s
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict | None] | None = None  # with SamplingParams.prompt_logprobs


def _output(req: Request) -> Output:
    m = req.metrics
    n = req.num_output_tokens
    decode_time = (m.finished - m.first_token) if m.finished and m.first_token else 0.0
    return Output(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=req.token_ids[: req.num_prompt_tokens],
        text=req.detok.text if req.detok is not None else "",
        token_ids=req.output_token_ids,
        finish_reason=req.finish_reason,
        num_cached_tokens=req.num_cached_tokens,
        metrics={
            "queue_time": m.queue_time,
            "ttft": m.ttft,
            "e2e": m.e2e,
            "decode_tokens_per_s": (n - 1) / decode_time if n > 1 and decode_time > 0 else None,
            "num_preemptions": m.num_preemptions,
        },
        logprobs=list(req.logprobs),
        prompt_logprobs=req.prompt_logprobs,
    )


class LLM:
    """Generate offline. `model` is a Hugging Face-format directory (None: the bundled demo
    model); options are `EngineConfig` fields (device, dtype, max_batch, speculative, ...)."""

    def __init__(self, model: str | None = None, **options):
        self.engine = LLMEngine(EngineConfig.from_options(model, options))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Output]:
        """`params` default: SamplingParams with the model's generation config's settings."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams(**self.engine.factory.sampling_defaults)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        # validate everything before anything runs
        reqs = [
            self.engine.make_request(Submission(p, sp))
            for p, sp in zip(prompts, plist, strict=True)
        ]
        for req in reqs:
            self.engine.add(req)
        while self.engine.has_unfinished():
            self.engine.step()
        return [_output(r) for r in reqs]

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers, if any (they also stop when this
        process ends)."""
        self.engine.close()
