"""Per-request sampling and stopping options, validated on construction.

Every option is range-checked here (and against the model's vocabulary in
`LLMEngine.make_request`), so that no value a client sends can make an engine step raise."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from expresslane.errors import InvalidRequestError

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes [0, 2**64)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
MAX_LOGPROBS = 20


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise InvalidRequestError(
            "{" + name + "} must be an integer {bound}, got {value}",
            param=name,
            values={"bound": bound, "value": repr(value)},
        )


def _check_real(name: str, value, ok, bound: str) -> None:
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not real or not math.isfinite(value) or not ok(value):
        raise InvalidRequestError(
            "{" + name + "} must be {bound}, got {value}",
            param=name,
            values={"bound": bound, "value": repr(value)},
        )


@dataclass(frozen=True)
class Grammar:
    """A constraint on the output text: an llguidance grammar (Lark syntax; it may embed JSON
    schemas with `%json`). `param` is the request field it came from, named in errors."""

    lark: str
    param: str = "grammar"


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
    grammar: Grammar | None = None  # constrained decoding (engine/grammar.py)
    # logit adjustments (engine/penalties.py), OpenAI's and vLLM's names and meanings
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit
    min_p: float = 0.0
    prompt_logprobs: int | None = None  # None: none; n >= 0: each prompt token's plus the top n

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)  # at most max_tokens
        _check_real(
            "temperature",
            self.temperature,
            lambda t: 0.0 <= t <= 100.0,
            "a number between 0 and 100 (0 is greedy)",
        )
        _check_real("top_p", self.top_p, lambda p: 0.0 < p <= 1.0, "a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(
                "{top_k} must be -1 or 0 (disabled) or a positive count, got {value}",
                param="top_k",
                values={"value": repr(self.top_k)},
            )
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        self._check_stops()
        self._check_logit_controls()

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                "at most {most} {stop} strings are allowed, got {got}",
                param="stop",
                values={"most": MAX_STOP_STRINGS, "got": len(self.stop)},
            )
        for s in self.stop:
            if not isinstance(s, str) or len(s) > MAX_STOP_CHARS:
                raise InvalidRequestError(
                    "each {stop} string must be a string of at most {most} characters",
                    param="stop",
                    values={"most": MAX_STOP_CHARS},
                )
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise InvalidRequestError(
                    "{stop_token_ids} must be non-negative token ids, got {value}",
                    param="stop_token_ids",
                    values={"value": repr(t)},
                )

    def _check_logit_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            _check_real(name, getattr(self, name), lambda v: -2.0 <= v <= 2.0, "between -2 and 2")
        _check_real(
            "repetition_penalty", self.repetition_penalty, lambda v: v > 0.0, "greater than 0"
        )
        _check_real("min_p", self.min_p, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if not self.logit_bias:
            self.logit_bias = None
            return
        if not isinstance(self.logit_bias, dict):
            raise InvalidRequestError(
                "{logit_bias} must map token ids to biases", param="logit_bias", values={}
            )
        for t, bias in self.logit_bias.items():
            if not _is_int(t) or t < 0:
                raise InvalidRequestError(
                    "{logit_bias} keys must be non-negative token ids, got {value}",
                    param="logit_bias",
                    values={"value": repr(t)},
                )
            _check_real(
                "logit_bias", bias, lambda v: -100.0 <= v <= 100.0, "a map to biases in [-100, 100]"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or biases change this request's logits (engine/penalties.py)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )
