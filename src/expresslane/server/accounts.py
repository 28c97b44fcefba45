"""Who may do what: authentication, tier entitlement, lane availability, rate limits, quota,
and the ledger row written when a request ends.

The order for one request: the key (401) -> the tier it asks for, `auto` meaning the key's
default -> entitlement (403, or downgrade) -> lane full (queue, downgrade or 429, per key) ->
queue bounds (429 `queue_full` when the lane's queue is full, `too_many_requests_in_flight`
past the key's in-flight limit) -> monthly quota (429 `insufficient_quota`) -> requests/min and
tokens/min of the served tier (429 with Retry-After). Every 429 carries `x-ratelimit-*` headers.
The outcome is a `Ticket` that travels with the request.

`path` names the accounts database: a SQLite file (rate limits then count in this process), or
a PostgreSQL URL that several servers share: keys, ledger and the rate-limit buckets
(`shared_limits.py`) then hold across all of them. The in-flight bound stays per server.
"""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass, field

from expresslane.lanes import LANE_NAMES, Lane, lane_for, place, queue_capacity, served
from expresslane.promise import Stated, Verdict
from expresslane.server.database import connect
from expresslane.server.errors import APIError
from expresslane.server.keys import OPEN_ACCESS, ApiKey, KeyStore, Plan
from expresslane.server.metering import Ledger, LedgerRow, Prices, month_start
from expresslane.server.ratelimit import RateLimiter, go_duration
from expresslane.server.shared_limits import SharedRateLimiter

log = logging.getLogger("expresslane.server")
# The key given with `serve --api-key` (as vLLM takes it): every tier, no limits.
SERVER_KEY = ApiKey("api-key", "api-key", "", Plan(tiers=list(LANE_NAMES)), 0.0)


@dataclass
class Ticket:
    key: ApiKey
    tier_requested: str  # the lane its service_tier named (`lanes.lane_for`)
    lane: str  # the lane that serves it (echoed as the response's service_tier)
    headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-* for the response
    # what the request's generations used (summed over its choices), for its log line
    usage: dict[str, float] = field(default_factory=dict)
    promise: Stated | None = None  # the serving lane's promise, each generation judged by it

    @property
    def owner(self) -> str:
        """Who owns what this request stores (see `ApiKey.owner`)."""
        return self.key.owner

    @property
    def regions(self) -> list[str] | None:
        """Where a fleet may serve it (data residency); None: anywhere."""
        return self.key.plan.regions

    def add_usage(self, tokens: tuple[int, int, int], timings: dict[str, float | None]) -> None:
        for name, n in zip(("input_tokens", "cached_tokens", "output_tokens"), tokens):
            self.usage[name] = self.usage.get(name, 0) + n
        for name, seconds in timings.items():
            if seconds is not None:
                keep = min if name in ("queue_s", "ttft_s") else max  # the first, the longest
                self.usage[name] = keep(self.usage.get(name, seconds), seconds)


@dataclass
class QueueLimits:
    """How much work may wait: per lane beyond its max batch (None: as many again as its max
    batch) and per key (running or waiting, all tiers; None: unbounded)."""

    per_lane: int | None = None
    per_key: int | None = 256

    def lane_capacity(self, lane: Lane) -> int:
        return queue_capacity(lane, self.per_lane)


class Accounts:
    def __init__(
        self,
        path: str,
        prices: Prices,
        lanes: dict[str, Lane],
        queue_limits: QueueLimits | None = None,
        api_key: str | None = None,
    ):
        self.api_key = api_key  # `serve --api-key`: SERVER_KEY's secret
        db = connect(path)
        self.keys = KeyStore(db)
        self.ledger = Ledger(db)
        self.limiter = SharedRateLimiter(db) if db.shared else RateLimiter()
        self.prices = prices
        self.lanes = lanes
        self.queue_limits = queue_limits or QueueLimits()
        self.in_flight: dict[str, int] = {}  # key id -> requests charged and not finished
        if not api_key and not self.keys.has_keys():
            log.warning(
                "no API keys configured: open local mode, every tier open to anyone who can "
                "reach the server (create one with `expresslane keys create NAME`)"
            )

    def close(self) -> None:
        self.keys.db.close()

    # -- per request -------------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> ApiKey:
        scheme, _, secret = (authorization or "").partition(" ")
        secret = secret.strip() if scheme.lower() == "bearer" else ""
        key = self.keys.lookup(secret) if secret else None
        if key is not None:  # the common case costs one query
            return key
        if self.api_key and secret and hmac.compare_digest(secret, self.api_key):
            return SERVER_KEY
        if not self.api_key and not self.keys.has_keys():
            return OPEN_ACCESS
        if not secret:
            raise APIError(
                401,
                "Missing API key: send it as 'Authorization: Bearer <key>' (the openai SDK "
                "does this with api_key=...).",
                code="invalid_api_key",
            )
        raise APIError(
            401, f"Incorrect or revoked API key provided: {secret[:6]}…", code="invalid_api_key"
        )

    def admit(self, key: ApiKey, service_tier: str | None, lane_load, room) -> Ticket:
        """Decide the lane that serves a request (the policy is `lanes.place`); raises
        400/403/429 APIErrors. `lane_load(lane)` counts the requests of that lane in flight,
        `room(lane)` says whether it can take one more now (`ServingEngine.lane_room`)."""
        plan = key.plan
        placed = place(self.lanes, lane_for(service_tier, plan.default_tier), plan, room)
        asked = placed.asked
        if placed.refusal == "not_served":
            raise APIError(
                400,
                f"The '{asked}' service tier is not offered by this server; it offers "
                f"{served(self.lanes)}.",
                param="service_tier",
                code="unsupported_service_tier",
            )
        if placed.refusal == "not_allowed":
            raise APIError(
                403,
                f"This API key may not use the '{asked}' service tier; it may use "
                f"{plan.tiers}. Ask for one of those, or for 'auto'.",
                param="service_tier",
                code="tier_not_allowed",
            )
        if placed.refusal == "at_capacity":
            running = lane_load(asked)
            raise self._busy(
                key,
                asked,
                running,
                f"The '{asked}' tier is at capacity ({running} requests in flight: one more "
                "would slow them below the tier's promised speed, or past its max batch); "
                "retry shortly, or use another tier.",
                "tier_at_capacity",
            )
        lane = placed.lane
        self._check_queues(key, lane, lane_load)
        if plan.monthly_tokens is not None:
            used = self.ledger.tokens_since(key.id, month_start())
            if used >= plan.monthly_tokens:
                raise APIError(
                    429,
                    f"You exceeded your monthly quota of {plan.monthly_tokens} tokens "
                    f"({used} used this month); it renews on the 1st (UTC).",
                    code="insufficient_quota",
                    type="insufficient_quota",
                    headers={"x-should-retry": "false", **self._quota_headers(key, lane)},
                )
        return Ticket(key, asked, lane)

    def _quota_headers(self, key: ApiKey, tier: str) -> dict[str, str]:
        limits = key.plan.limits_for(tier)
        renews = month_start(month_start() + 32 * 86400)
        return self.limiter.peek(key.id, tier, limits.rpm, limits.tpm) or {
            "x-ratelimit-limit-tokens": str(key.plan.monthly_tokens),
            "x-ratelimit-remaining-tokens": "0",
            "x-ratelimit-reset-tokens": go_duration(renews - time.time()),
        }

    def saturated(self, lane_load) -> bool:
        """Whether every enabled lane's queue is full (no request could be admitted)."""
        capacity = self.queue_limits.lane_capacity
        return all(lane_load(name) >= capacity(self.lanes[name]) for name in served(self.lanes))

    def _check_queues(self, key: ApiKey, tier: str, lane_load) -> None:
        """429 instead of an unbounded wait: the lane's queue is full, or the key has as
        many requests in flight as it may."""
        capacity = self.queue_limits.lane_capacity(self.lanes[tier])
        if lane_load(tier) >= capacity:
            raise self._busy(
                key,
                tier,
                capacity,
                f"The '{tier}' tier has {capacity} requests running or waiting, as many as "
                "this server queues; retry after the Retry-After delay.",
                "queue_full",
            )
        per_key = self.queue_limits.per_key
        if per_key is not None and self.in_flight.get(key.id, 0) >= per_key:
            raise self._busy(
                key,
                tier,
                per_key,
                f"This API key has {per_key} requests in flight, as many as it may; wait for "
                "some to finish.",
                "too_many_requests_in_flight",
            )

    def _busy(self, key: ApiKey, tier: str, capacity: int, message: str, code: str) -> APIError:
        """A 429 for a full queue: Retry-After, and the key's rate-limit headers as they
        stand (or, for a key without limits, the capacity that was reached)."""
        limits = key.plan.limits_for(tier)
        headers = self.limiter.peek(key.id, tier, limits.rpm, limits.tpm) or {
            "x-ratelimit-limit-requests": str(capacity),
            "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": "1s",
        }
        headers |= {"retry-after": "1", "retry-after-ms": "1000"}
        return APIError(429, message, code=code, headers=headers)

    def charge(self, ticket: Ticket, tokens: int, requests: int = 1) -> None:
        """Take one request and `tokens` (an estimate) from the served tier's limits; the
        key then has `requests` more in flight until `finish` is called for each."""
        limits = ticket.key.plan.limits_for(ticket.lane)
        d = self.limiter.take(ticket.key.id, ticket.lane, limits.rpm, limits.tpm, tokens)
        ticket.headers = d.headers
        if not d.allowed:
            per = {"requests": limits.rpm, "tokens": limits.tpm}[d.limit]
            raise APIError(
                429,
                f"Rate limit reached for the '{ticket.lane}' tier on {d.limit} per minute: "
                f"limit {per}, requested {1 if d.limit == 'requests' else tokens}. Please try "
                f"again in {d.retry_after * 1000:.0f}ms.",
                code="rate_limit_exceeded",
                type=d.limit,
                headers=d.headers,
            )
        self.in_flight[ticket.key.id] = self.in_flight.get(ticket.key.id, 0) + requests

    def finish(
        self,
        ticket: Ticket,
        request_id: str,
        model: str,
        *,
        status: str,
        input_tokens: int,
        cached_tokens: int,
        output_tokens: int,
        estimated_tokens: int,
        timings: dict[str, float | None],
    ) -> LedgerRow:
        """Write the ledger row of an ended request and settle its token estimate (and return
        it). A request that failed on the server's side costs nothing; one that finished on
        a lane with a promise is judged by it (`_judge`)."""
        used = input_tokens + output_tokens
        left = self.in_flight.get(ticket.key.id, 1) - 1
        if left > 0:
            self.in_flight[ticket.key.id] = left
        else:
            self.in_flight.pop(ticket.key.id, None)
        self.limiter.settle(ticket.key.id, ticket.lane, estimated_tokens, used)
        tokens = (input_tokens, cached_tokens, output_tokens)
        ticket.add_usage(tokens, timings)
        ids = (request_id, ticket.key.id, ticket.tier_requested, ticket.lane, model)
        row = self._row(*ids, status, *tokens, timings)
        if ticket.promise is not None and status in ("stop", "length"):
            self._judge(row, ticket.promise, timings)
        self.ledger.record(row)
        return row

    def _judge(self, row: LedgerRow, promise: Stated, timings: dict[str, float | None]) -> None:
        """Record the promise and what was delivered on the row; a request that missed its
        promise is billed at the default lane's price, the difference recorded as refund."""
        verdict: Verdict = promise.judge(
            row.input_tokens, row.output_tokens, timings.get("ttft_s"), timings.get("decode_s")
        )
        row.promised_tokens_per_s = promise.tokens_per_s
        row.promised_ttft_s = promise.ttft_allowed(row.input_tokens)
        row.delivered_tokens_per_s = verdict.delivered_tokens_per_s
        row.promise_kept = int(verdict.kept)
        if not verdict.kept:
            default = self.lanes["default"].price_multiplier
            tokens = (row.input_tokens, row.cached_tokens, row.output_tokens)
            billed = self.prices.cost(*tokens, default)
            row.refund = max(0.0, row.cost - billed)
            row.cost -= row.refund

    def _row(
        self,
        request_id: str,
        key_id: str,
        tier_requested: str,
        tier_served: str,
        model: str,
        status: str,
        input_tokens: int,
        cached_tokens: int,
        output_tokens: int,
        timings: dict[str, float | None] | None = None,
    ) -> LedgerRow:
        """A ledger row priced at the serving lane's multiplier; errors cost nothing."""
        lane = self.lanes.get(tier_served)
        multiplier = lane.price_multiplier if lane is not None else 1.0
        cost = self.prices.cost(input_tokens, cached_tokens, output_tokens, multiplier)
        times = timings or dict.fromkeys(("queue_s", "ttft_s", "decode_s", "e2e_s"))
        return LedgerRow(
            request_id=request_id,
            key_id=key_id,
            tier_requested=tier_requested,
            tier_served=tier_served,
            model=model,
            status=status,
            input_tokens=input_tokens,
            cached_tokens=cached_tokens,
            output_tokens=output_tokens,
            cost=0.0 if status == "error" else cost,
            **times,
        )

    def record_interrupted(
        self,
        request_id: str,
        key_id: str,
        tier_requested: str,
        tier_served: str,
        model: str,
        *,
        input_tokens: int,
        cached_tokens: int,
        output_tokens: int,
    ) -> bool:
        """Bill a request the server was killed under (found unfinished when it restarts) for
        the tokens it had generated, priced like a finished one. Once per request id: False
        (nothing written) if the ledger already has a row for it."""
        ids = (request_id, key_id, tier_requested, tier_served, model)
        tokens = (input_tokens, cached_tokens, output_tokens)
        return self.ledger.record_once(self._row(*ids, "interrupted", *tokens))
