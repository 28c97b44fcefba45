"""Anthropic's rate-limit headers from a key's limits: the ultrafast lane's tokens/min in
`anthropic-fast-{input,output}-tokens-{limit,remaining,reset}` (fast mode's own pool), the
standard lane's in `anthropic-ratelimit-*`.

A lane has one tokens/min bucket for input and output together, so the `input-tokens` and
`output-tokens` headers report the same pool (as does `anthropic-ratelimit-tokens-*`). Resets
are RFC 3339 times, as Anthropic sends them, from the `x-ratelimit-reset-*` durations. A key
without limits on a lane gets no headers for it.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime

from expresslane.server.keys import ApiKey

FAST, STANDARD = "ultrafast", "default"
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def seconds(duration: str) -> float:
    """A Go duration as the `x-ratelimit-reset-*` headers write it (`850ms`, `6m0s`)."""
    parts = re.findall(r"([\d.]+)(ms|h|m|s)", duration)
    return sum(float(n) * _UNITS[unit] for n, unit in parts)


def _at(duration: str) -> str:
    when = datetime.fromtimestamp(time.time() + seconds(duration), UTC)
    return when.isoformat(timespec="seconds").replace("+00:00", "Z")


def _pool(prefix: str, headers: dict[str, str], kind: str, names: tuple[str, ...]) -> dict:
    out = {}
    for field in ("limit", "remaining", "reset"):
        value = headers.get(f"x-ratelimit-{field}-{kind}")
        if value is None:
            continue
        value = _at(value) if field == "reset" else value
        out |= {f"{prefix}-{name}-{field}": value for name in names}
    return out


def fast_headers(headers: dict[str, str]) -> dict[str, str]:
    return _pool("anthropic-fast", headers, "tokens", ("input-tokens", "output-tokens"))


def standard_headers(headers: dict[str, str]) -> dict[str, str]:
    tokens = ("tokens", "input-tokens", "output-tokens")
    out = _pool("anthropic-ratelimit", headers, "requests", ("requests",))
    return out | _pool("anthropic-ratelimit", headers, "tokens", tokens)


class RateLimitHeaders:
    """Maps the `x-ratelimit-*` headers of a request's lane (`lane`) to Anthropic's, peeking
    at the key's other pool (fast or standard) for the rest."""

    def __init__(self, accounts, key: ApiKey, lane: str):
        self.accounts = accounts
        self.key = key
        self.lane = lane

    def _peek(self, lane: str) -> dict[str, str]:
        if lane not in self.key.plan.tiers:
            return {}
        limits = self.key.plan.limits_for(lane)
        return self.accounts.limiter.peek(self.key.id, lane, limits.rpm, limits.tpm)

    def __call__(self, headers: dict[str, str]) -> dict[str, str]:
        fast = headers if self.lane == FAST else self._peek(FAST)
        standard = headers if self.lane != FAST else self._peek(STANDARD)
        return fast_headers(fast) | standard_headers(standard)
