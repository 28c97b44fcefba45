"""A request on a lane with a promise, judged when it ends (`Accounts.finish`): what was
promised and delivered goes on its ledger row, with what it missed; a miss is billed at the
default lane's price, the difference recorded as refund, unless the request missed its first
token waiting on its own account (`own_backlog`: its key held its share of the lane's running
slots; `queued_without_room`: its key's `queue` policy placed it on a lane without room)."""

from __future__ import annotations

import math

from expresslane.lanes import Lane
from expresslane.promise import Stated, Verdict
from expresslane.server.metering import LedgerRow, Prices


def no_refund(lane: Lane, share: float, held: int, generations: int, queued: bool) -> str | None:
    """Why a first token a request waits for is on its own account: with its `generations`,
    its key holds (`held` before them) more than its `share` of the lane's running slots, or
    it was queued without room."""
    slots = max(1, math.ceil(share * lane.max_batch))
    if held + generations > slots:
        return "own_backlog"
    return "queued_without_room" if queued else None


def judge(
    row: LedgerRow,
    promise: Stated,
    timings: dict[str, float | None],
    withheld: str | None,
    default_price: tuple[Prices, float],
) -> None:
    """Record the verdict on `row`; `withheld` (a `no_refund` reason) keeps a TTFT miss's
    refund; `default_price` is the prices and the default lane's multiplier."""
    verdict: Verdict = promise.judge(
        row.input_tokens, row.output_tokens, timings.get("ttft_s"), timings.get("decode_s")
    )
    row.promised_tokens_per_s = promise.tokens_per_s
    row.promised_ttft_s = promise.ttft_allowed(row.input_tokens)
    row.delivered_tokens_per_s = verdict.delivered_tokens_per_s
    row.promise_kept = int(verdict.kept)
    row.missed = verdict.missed
    if verdict.missed == "ttft" and withheld is not None:
        row.refund_withheld = withheld
    elif not verdict.kept:
        prices, multiplier = default_price
        billed = prices.cost(row.input_tokens, row.cached_tokens, row.output_tokens, multiplier)
        row.refund = max(0.0, row.cost - billed)
        row.cost -= row.refund
