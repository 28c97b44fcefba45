"""Requests/min and tokens/min per key and tier: token buckets, and OpenAI's rate-limit headers.

A bucket holds up to one minute's allowance and refills continuously. A request takes one from
the requests bucket per generation it asks for (`n` times its prompts) when it is admitted, and
its estimated tokens (prompts + max output tokens) from the tokens bucket once tokenized;
when it finishes, the estimate is corrected to the tokens it really used, so a bucket may go
below zero and the next request then waits. A refused request gets 429 with `Retry-After`
(whole seconds) and `retry-after-ms`, which the openai SDK honors.

`RateLimiter` keeps the buckets in this process; with a database several servers share,
`shared_limits.SharedRateLimiter` keeps them there (same decisions, same headers).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass


def go_duration(seconds: float) -> str:
    """OpenAI's reset format: `0s`, `850ms`, `12s`, `6m0s`, `1h2m3s`."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    whole = math.ceil(seconds)
    h, rest = divmod(whole, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{s}s"
    if m:
        return f"{m}m{s}s"
    return f"{s}s"


class Bucket:
    def __init__(self, per_minute: int, level: float | None = None):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # refill per second
        self.level = float(per_minute if level is None else level)
        self.stamp = time.monotonic()

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0 if it is now)."""
        if amount > self.capacity:
            amount = self.capacity  # a request larger than a minute's allowance waits for all
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / self.rate

    def reset_in(self) -> float:
        return max(0.0, (self.capacity - self.level) / self.rate)


@dataclass
class Decision:
    allowed: bool
    retry_after: float  # seconds, when refused
    headers: dict[str, str]
    limit: str | None = None  # "requests" or "tokens": what was exhausted


Buckets = dict  # kind ("requests", "tokens") -> (refilled Bucket or None: no limit, amount)


def decide(buckets: Buckets, allowed: bool | None = None) -> Decision:
    """Take every amount if all are available (or as `allowed` says, when the buckets' store
    decided already), else refuse, taking nothing; the decision with its headers."""
    waits = {k: b.wait_for(amount) for k, (b, amount) in buckets.items() if b is not None}
    worst = max(waits, key=waits.get, default=None)
    if allowed is None:
        allowed = worst is None or waits[worst] == 0
    if allowed:
        for b, amount in buckets.values():
            if b is not None:
                b.level -= amount
        return Decision(True, 0.0, headers(buckets))
    wait = waits[worst]
    refused = headers(buckets)
    refused["retry-after"] = str(max(1, math.ceil(wait)))
    refused["retry-after-ms"] = str(max(1, math.ceil(wait * 1000)))
    return Decision(False, wait, refused, limit=worst)


def headers(buckets: Buckets) -> dict[str, str]:
    """The `x-ratelimit-*` headers of the buckets as they stand."""
    out = {}
    for kind, (b, _) in buckets.items():
        if b is None:
            continue
        out[f"x-ratelimit-limit-{kind}"] = str(int(b.capacity))
        out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(b.level)))
        out[f"x-ratelimit-reset-{kind}"] = go_duration(b.reset_in())
    return out


class RateLimiter:
    def __init__(self):
        self._buckets: dict[tuple[str, str, str], Bucket] = {}
        self._lock = threading.Lock()

    def _bucket(self, key_id: str, tier: str, kind: str, per_minute: int | None) -> Bucket | None:
        if per_minute is None:
            return None
        b = self._buckets.get((key_id, tier, kind))
        if b is None or b.capacity != per_minute:
            b = self._buckets[(key_id, tier, kind)] = Bucket(per_minute)
        return b

    def take(
        self,
        key_id: str,
        tier: str,
        rpm: int | None,
        tpm: int | None,
        tokens: int,
        requests: int = 1,
    ) -> Decision:
        """Take `requests` and `tokens` if both are available, else refuse (nothing taken)."""
        now = time.monotonic()
        with self._lock:
            buckets = {
                "requests": (self._bucket(key_id, tier, "requests", rpm), requests),
                "tokens": (self._bucket(key_id, tier, "tokens", tpm), tokens),
            }
            for b, _ in buckets.values():
                if b is not None:
                    b.refill(now)
            return decide(buckets)

    def peek(self, key_id: str, tier: str, rpm: int | None, tpm: int | None) -> dict[str, str]:
        """The `x-ratelimit-*` headers of a key's buckets as they stand, taking nothing."""
        now = time.monotonic()
        with self._lock:
            buckets = {
                "requests": (self._bucket(key_id, tier, "requests", rpm), 1),
                "tokens": (self._bucket(key_id, tier, "tokens", tpm), 0),
            }
            for b, _ in buckets.values():
                if b is not None:
                    b.refill(now)
            return headers(buckets)

    def settle(self, key_id: str, tier: str, estimated: int, used: int) -> None:
        """Correct a request's token estimate to what it really used."""
        with self._lock:
            b = self._buckets.get((key_id, tier, "tokens"))
            if b is not None:
                b.refill(time.monotonic())
                b.level = min(b.capacity, b.level + estimated - used)
