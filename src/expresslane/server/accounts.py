"""Who may do what: authentication, tier entitlement, lane availability, rate limits, quota,
and the ledger row written when a request ends.

The order for one request: the key (401) -> the tier it asks for, `auto` meaning the key's
default -> entitlement (403, or downgrade) -> lane full (queue, downgrade or 429, per key) ->
queue bounds (`in_flight.py`: 429 `queue_full` when the lane's queue is full,
`lane_share_exceeded` past the key's share of the lane, `too_many_requests_in_flight` past the
key's in-flight limit; 400 `too_many_generations` for a request larger than any of them) ->
monthly quota (429 `insufficient_quota`) -> requests/min of the served tier (429 with
Retry-After) -> [the endpoint tokenizes] -> tokens/min (429). Every 429 carries
`x-ratelimit-*` headers. Bounds and limits count generations (`n` choices times prompts), and
they are reserved at admission, so concurrent requests cannot all pass one check. The outcome
is a `Ticket` that travels with the request.

`path` names the accounts database: a SQLite file (rate limits then count in this process), or
a PostgreSQL URL that several servers share: keys, ledger and the rate-limit buckets
(`shared_limits.py`) then hold across all of them. The in-flight bound stays per server.
"""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass, field

from expresslane.lanes import LANE_NAMES, Lane, lane_for, place, served
from expresslane.promise import Stated
from expresslane.server.database import connect
from expresslane.server.errors import APIError
from expresslane.server.in_flight import InFlight, QueueLimits
from expresslane.server.judging import judge, no_refund
from expresslane.server.keys import OPEN_ACCESS, OPERATOR_KEY_ID, ApiKey, KeyStore, Plan
from expresslane.server.metering import Ledger, LedgerRow, Prices, month_start
from expresslane.server.ratelimit import RateLimiter, go_duration
from expresslane.server.shared_limits import SharedRateLimiter

log = logging.getLogger("expresslane.server")
# The key given with `serve --api-key` (as vLLM takes it): every tier, no limits.
SERVER_KEY = ApiKey(OPERATOR_KEY_ID, "api-key", "", Plan(tiers=list(LANE_NAMES)), 0.0)


def shares_lanes(key: ApiKey) -> bool:
    """Whether a key's requests take a tenant's share of a lane (`Lane.key_share`): not in open
    mode (no one to share with), nor an operator's (the house's own traffic)."""
    return not (key.operator or key.id == OPEN_ACCESS.id)


@dataclass
class Ticket:
    key: ApiKey
    tier_requested: str  # the lane its service_tier named (`lanes.lane_for`)
    lane: str  # the lane that serves it (echoed as the response's service_tier)
    headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-* for the response
    # what the request's generations used (summed over its choices), for its log line
    usage: dict[str, float] = field(default_factory=dict)
    promise: Stated | None = None  # the serving lane's promise, each generation judged by it
    # why a missed first token is not refunded: it waited behind its own key's work
    # ("own_backlog"), or was queued by the key's policy on a lane without room
    # ("queued_without_room"); None: refunded
    no_refund: str | None = None
    held: int = 0  # generations reserved in `Accounts.in_flight` and not yet ended

    @property
    def owner(self) -> str:
        """Who owns what this request stores (see `ApiKey.owner`)."""
        return self.key.owner

    @property
    def tenant(self) -> str | None:
        """Whose share of a lane it takes: its key's id, None where it takes none (open mode,
        an operator's key: `shares_lanes`)."""
        return self.key.id if shares_lanes(self.key) else None

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
        self.in_flight = InFlight()  # generations admitted and not ended, per key and lane
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

    def admit(
        self, key: ApiKey, service_tier: str | None, lane_load, room, generations: int = 1
    ) -> Ticket:
        """Decide the lane that serves a request of `generations` engine requests (the
        policy is `lanes.place`) and reserve them; raises 400/403/429 APIErrors.
        `lane_load(lane)` counts the requests of that lane in the engine, `room(lane)` says
        whether it can take one more now (`ServingEngine.lane_room`). The caller must
        `release` the ticket if its request fails before all its generations start."""
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
        self._check_queues(key, lane, generations)
        self._check_quota(key, lane)
        limits = plan.limits_for(lane)
        d = self.limiter.take(key.id, lane, limits.rpm, limits.tpm, 0, requests=generations)
        if not d.allowed:
            raise self._limited(lane, limits, d, generations, 0)
        ticket = Ticket(key, asked, lane, headers=d.headers, held=generations)
        share = self.lanes[lane].key_share if shares_lanes(key) else 1.0
        held = self.in_flight.key_lane(key.id, lane)
        ticket.no_refund = no_refund(self.lanes[lane], share, held, generations, placed.queued)
        self.in_flight.add(key.id, lane, generations)
        return ticket

    def _check_quota(self, key: ApiKey, lane: str) -> None:
        monthly = key.plan.monthly_tokens
        if monthly is None:
            return
        used = self.ledger.tokens_since(key.id, month_start())
        if used >= monthly:
            raise APIError(
                429,
                f"You exceeded your monthly quota of {monthly} tokens "
                f"({used} used this month); it renews on the 1st (UTC).",
                code="insufficient_quota",
                type="insufficient_quota",
                headers={"x-should-retry": "false", **self._quota_headers(key, lane)},
            )

    def release(self, ticket: Ticket, keep: int = 0) -> None:
        """Give back the generations a ticket reserved and has not ended, but `keep` (those
        that started: each gives its own back when it ends)."""
        extra = ticket.held - keep
        if extra > 0:
            self.in_flight.remove(ticket.key.id, ticket.lane, extra)
            ticket.held = keep

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
        return all(
            max(lane_load(name), self.in_flight.lane(name)) >= capacity(self.lanes[name])
            for name in served(self.lanes)
        )

    def _check_queues(self, key: ApiKey, tier: str, generations: int) -> None:
        """429 instead of an unbounded wait: the lane's queue is full, the key holds its share
        of the lane, or it has as many generations in flight as it may; a 400 for a request
        larger than the bound itself."""
        lane = self.lanes[tier]
        bounds = [
            (
                self.queue_limits.lane_capacity(lane),
                self.in_flight.lane(tier),
                "queue_full",
                f"The '{tier}' tier has {{used}} requests running or waiting, and queues at "
                "most {bound}; retry after the Retry-After delay.",
            ),
            (
                self.queue_limits.key_capacity(lane, shares_lanes(key)),
                self.in_flight.key_lane(key.id, tier),
                "lane_share_exceeded",
                f"This API key has {{used}} requests running or waiting in the '{tier}' tier, "
                "and one key may hold at most {bound} there (its share of the tier); wait "
                "for some to finish.",
            ),
        ]
        if self.queue_limits.per_key is not None:
            bounds.append(
                (
                    self.queue_limits.per_key,
                    self.in_flight.key(key.id),
                    "too_many_requests_in_flight",
                    "This API key has {used} requests in flight, and may have at most "
                    "{bound}; wait for some to finish.",
                )
            )
        for bound, used, code, message in bounds:
            if generations > bound:
                raise APIError(
                    400,
                    f"This request asks for {generations} generations (n times the prompts), "
                    f"more than the {bound} that its bound ({code}) allows at once in the "
                    f"'{tier}' tier; send fewer prompts or choices per request.",
                    param="n",
                    code="too_many_generations",
                )
            if used + generations > bound:
                raise self._busy(key, tier, bound, message.format(used=used, bound=bound), code)

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

    def charge(self, ticket: Ticket, tokens: int) -> None:
        """Take `tokens` (an estimate: prompts plus their output limits) from the served
        tier's tokens/min (the requests were taken at admission)."""
        limits = ticket.key.plan.limits_for(ticket.lane)
        d = self.limiter.take(ticket.key.id, ticket.lane, limits.rpm, limits.tpm, tokens, 0)
        ticket.headers = d.headers
        if not d.allowed:
            raise self._limited(ticket.lane, limits, d, 0, tokens)

    def _limited(self, tier: str, limits, d, requests: int, tokens: int) -> APIError:
        per = {"requests": limits.rpm, "tokens": limits.tpm}[d.limit]
        return APIError(
            429,
            f"Rate limit reached for the '{tier}' tier on {d.limit} per minute: "
            f"limit {per}, requested {requests if d.limit == 'requests' else tokens}. Please "
            f"try again in {d.retry_after * 1000:.0f}ms.",
            code="rate_limit_exceeded",
            type=d.limit,
            headers=d.headers,
        )

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
        if ticket.held > 0:
            ticket.held -= 1
            self.in_flight.remove(ticket.key.id, ticket.lane)
        self.limiter.settle(ticket.key.id, ticket.lane, estimated_tokens, used)
        tokens = (input_tokens, cached_tokens, output_tokens)
        ticket.add_usage(tokens, timings)
        ids = (request_id, ticket.key.id, ticket.tier_requested, ticket.lane, model)
        row = self._row(*ids, status, *tokens, timings)
        if ticket.promise is not None and status in ("stop", "length"):
            default = (self.prices, self.lanes["default"].price_multiplier)
            judge(row, ticket.promise, timings, ticket.no_refund, default)
        self.ledger.record_once(row)
        return row

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
        """A ledger row priced at the serving lane's multiplier; an error costs what it had
        delivered (nothing, if it failed before its first token)."""
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
            cost=0.0 if status == "error" and not output_tokens else cost,
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
