"""Per-request sampling and stopping options, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from expresslane.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    `temperature=0` is greedy. `top_k <= 0` and `top_p == 1` disable those filters. A `seed`
    makes sampling reproducible for this request whatever else is in the batch. Stop strings
    are removed from the returned text; stop token ids and EOS end generation (unless
    `ignore_eos`) once `min_tokens` have been produced.
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n >= 0: the sampled token's plus the top n
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens"
            )
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise InvalidRequestError(
                f"min_tokens must be between 0 and max_tokens, got {self.min_tokens}",
                param="min_tokens",
            )
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(
                f"temperature must be between 0 and 100 (0 is greedy), got {self.temperature}",
                param="temperature",
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1 or 0 (disabled) or a positive count, got {self.top_k}",
                param="top_k",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(
                f"logprobs must be between 0 and 20, got {self.logprobs}", param="logprobs"
            )
        if len(self.stop) > 16:
            raise InvalidRequestError("at most 16 stop strings are allowed", param="stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
