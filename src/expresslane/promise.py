"""A lane's promise: the speed its requests are sold, and whether a request got it.

A promise has two parts, as OpenAI states its Priority tier's objective: a decode speed that
the lane's requests reach at a percentile (p50) over every window (5 minutes), and a floor per
request (a fraction of that speed) below which a request missed it. Time to first token is
promised for prompts of up to `prompt_tokens` tokens, and in proportion beyond. A request that
missed its promise is billed at the default lane's price (server/accounts.py).

"auto" values are measured by the engine at startup (`engine/lane_room.py` resolves them from
the step-latency model) and then fixed: a published promise does not move with each refit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from expresslane.errors import InvalidRequestError


@dataclass(frozen=True)
class Promise:
    """What a lane promises, as configured (`[lanes.NAME.promise]`)."""

    tokens_per_s: float | str = "auto"  # decode speed at `percentile` in every window
    ttft_s: float | str = "auto"  # time to first token for prompts of up to prompt_tokens
    prompt_tokens: int = 1024
    floor_fraction: float = 0.5  # a request below this fraction of tokens_per_s missed it
    # The speed of fewer output tokens is mostly scheduling noise: such requests are judged by
    # their time to first token alone.
    min_output_tokens: int = 16
    percentile: float = 50.0
    window_s: float = 300.0

    @classmethod
    def from_table(cls, lane: str, table: dict | Promise | bool | None) -> Promise | None:
        """A `[lanes.NAME.promise]` table (false: no promise)."""
        if table is None or table is False or isinstance(table, Promise):
            return table or None
        if table is True:
            return cls()
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown promise setting(s) {unknown} for lane {lane!r}; known: {sorted(known)}"
            )
        promise = cls(**table)
        promise.check(lane)
        return promise

    def check(self, lane: str) -> None:
        for name in ("tokens_per_s", "ttft_s"):
            value = getattr(self, name)
            if value != "auto" and not (isinstance(value, (int, float)) and value > 0):
                raise InvalidRequestError(
                    f'lane {lane!r}: promise {name} must be a positive number or "auto"'
                )
        if not 0 < self.floor_fraction <= 1 or not 0 < self.percentile < 100:
            raise InvalidRequestError(
                f"lane {lane!r}: promise floor_fraction must be in (0, 1] and percentile in "
                "(0, 100)"
            )
        if self.prompt_tokens < 1 or self.window_s <= 0 or self.min_output_tokens < 2:
            raise InvalidRequestError(
                f"lane {lane!r}: promise prompt_tokens and window_s must be positive, "
                "min_output_tokens at least 2"
            )

    @property
    def is_auto(self) -> bool:
        return self.tokens_per_s == "auto" or self.ttft_s == "auto"

    def stated(self, tokens_per_s: float, ttft_s: float) -> Stated:
        """The promise with its "auto" parts measured (`tokens_per_s`, `ttft_s`)."""
        return Stated(
            tokens_per_s=_number(self.tokens_per_s, tokens_per_s),
            ttft_s=_number(self.ttft_s, ttft_s),
            prompt_tokens=self.prompt_tokens,
            floor_fraction=self.floor_fraction,
            min_output_tokens=self.min_output_tokens,
            percentile=self.percentile,
            window_s=self.window_s,
            measured=self.is_auto,
        )


def _number(value: float | str, measured: float) -> float:
    return float(measured if value == "auto" else value)


@dataclass(frozen=True)
class Verdict:
    """One request judged against its lane's promise."""

    kept: bool
    delivered_tokens_per_s: float | None  # None: fewer than two output tokens
    ttft_s: float | None
    missed: str | None = None  # "ttft" or "speed"


@dataclass(frozen=True)
class Stated:
    """A promise as published and checked: every value a number."""

    tokens_per_s: float
    ttft_s: float
    prompt_tokens: int
    floor_fraction: float
    min_output_tokens: int
    percentile: float
    window_s: float
    measured: bool = False  # some value was "auto"

    @property
    def floor_tokens_per_s(self) -> float:
        return self.tokens_per_s * self.floor_fraction

    def ttft_allowed(self, prompt_tokens: int) -> float:
        """The TTFT promised to a prompt of this many tokens."""
        return self.ttft_s * max(1.0, prompt_tokens / self.prompt_tokens)

    def judge(
        self, prompt_tokens: int, output_tokens: int, ttft_s: float | None, decode_s: float | None
    ) -> Verdict:
        """A finished request's verdict: its TTFT within the allowance and, with at least
        `min_output_tokens`, its decode speed (output tokens after the first over the time
        from first to last) at least the floor."""
        speed = None
        if output_tokens > 1 and decode_s:
            speed = (output_tokens - 1) / decode_s
        if ttft_s is None or ttft_s > self.ttft_allowed(prompt_tokens):
            return Verdict(False, speed, ttft_s, "ttft")
        judged = speed is not None and output_tokens >= self.min_output_tokens
        if judged and speed < self.floor_tokens_per_s:
            return Verdict(False, speed, ttft_s, "speed")
        return Verdict(True, speed, ttft_s)

    def as_dict(self) -> dict:
        """The promise as `/v1/tiers` publishes it."""
        return {
            "tokens_per_s": round(self.tokens_per_s, 1),
            "percentile": self.percentile,
            "window_s": self.window_s,
            "floor_tokens_per_s": round(self.floor_tokens_per_s, 1),
            "ttft_s": round(self.ttft_s, 3),
            "ttft_prompt_tokens": self.prompt_tokens,
            "speed_judged_from_output_tokens": self.min_output_tokens,
            "measured": self.measured,
            "when_missed": "billed at the default tier's price",
        }
