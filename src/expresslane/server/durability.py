"""What a stored response keeps when the server stops under it.

- `ProgressClock`: how often a running stored response saves its progress (output so far,
  usage so far): once at least `PROGRESS_SECONDS` have passed and `PROGRESS_TOKENS` tokens were
  generated since the last save, or `PROGRESS_MAX_SECONDS` with any new token. Each save is one
  row write, taken off the event loop by the store's writer thread, so its cost per token is
  bounded by 1/64 of a row write.
- `mark_interrupted`: a response the server stopped becomes `incomplete`, keeping its output,
  with `incomplete_details.reason` and an `error` that say why.
- `recover`: when the server starts, and every `SWEEP_SECONDS` after, responses left
  `queued`/`in_progress` by a server that is gone (killed; its lease, `store_lease.py`, says
  so) are marked so and their tokens billed in the ledger, once per response even if the
  server restarts again before the store is updated. Another live server's responses are not
  touched (two servers on the same files, a fleet ingress's rolling restart).
  The ledger takes one row per request id (`metering.py`), so an owner whose lease was
  taken while it stalled cannot bill a response the recovery billed, nor the reverse.
"""

from __future__ import annotations

import asyncio
import logging
import time

from expresslane.server.accounts import Accounts
from expresslane.server.store import ResponseStore

log = logging.getLogger("expresslane.server")

PROGRESS_SECONDS = 0.5
PROGRESS_TOKENS = 64
PROGRESS_MAX_SECONDS = 5.0
SWEEP_SECONDS = 5.0

RESTARTED = (
    "server_restarted",
    "The server stopped while this response was being generated and has restarted; the "
    "output generated until then is kept, and its tokens are billed. Send the request again "
    "(or continue it with previous_response_id) to get the rest.",
)
SHUT_DOWN = (
    "server_shutdown",
    "The server shut down before this response finished (its graceful shutdown period ran "
    "out); the output generated until then is kept, and its tokens are billed. Send the "
    "request again (or continue it with previous_response_id) to get the rest.",
)


class ProgressClock:
    def __init__(self) -> None:
        self.saved_at = time.monotonic()
        self.saved_tokens = 0

    def due(self, tokens: int) -> bool:
        """True (and the clock restarts) if progress at `tokens` output tokens should be saved."""
        new = tokens - self.saved_tokens
        if new <= 0:
            return False
        now = time.monotonic()
        elapsed = now - self.saved_at
        if (elapsed >= PROGRESS_SECONDS and new >= PROGRESS_TOKENS) or (
            elapsed >= PROGRESS_MAX_SECONDS
        ):
            self.saved_at, self.saved_tokens = now, tokens
            return True
        return False


def mark_interrupted(response: dict, why: tuple[str, str], usage: dict | None = None) -> None:
    """Make `response` (in place) an incomplete one, stopped for `why` (reason, message)."""
    reason, message = why
    for item in response.get("output", []):
        if item.get("status") == "in_progress":
            item["status"] = "incomplete"
    if usage is not None:
        response["usage"] = usage
    response["status"] = "incomplete"
    response["incomplete_details"] = {"reason": reason}
    response["error"] = {"code": reason, "message": message}
    response["completed_at"] = int(time.time())


def _tokens(usage: dict | None) -> tuple[int, int, int]:
    usage = usage or {}
    details = usage.get("input_tokens_details") or {}
    return (
        int(usage.get("input_tokens") or 0),
        int(details.get("cached_tokens") or 0),
        int(usage.get("output_tokens") or 0),
    )


def recover(store: ResponseStore, accounts: Accounts) -> int:
    """Mark the responses a killed server left unfinished as interrupted and bill them (the
    ledger row first: if the server dies before the store is updated, the next start finds
    the row and does not bill again). Returns how many."""
    left = store.unfinished()
    for stored in left:
        r, o = stored.response, stored.origin
        input_tokens, cached, output = _tokens(r.get("usage"))
        accounts.record_interrupted(
            o.request_id or r["id"],
            o.key_id,
            o.tier_requested,
            o.tier_served,
            o.model or r.get("model", ""),
            input_tokens=input_tokens,
            cached_tokens=cached,
            output_tokens=output,
        )
        if r.get("usage") is None:
            r["usage"] = _usage(input_tokens, cached, output)
        mark_interrupted(r, RESTARTED)
        store.put(r, stored.input_items, stored.context, o)
    store.flush()
    if left:
        log.warning("%d stored response(s) were left unfinished: marked incomplete", len(left))
    return len(left)


async def sweep(store: ResponseStore, accounts: Accounts, seconds: float = SWEEP_SECONDS):
    """Recover, every `seconds`, what servers that died since left unfinished (run as a task
    for the server's life)."""
    while True:
        await asyncio.sleep(seconds)
        try:
            await asyncio.to_thread(recover, store, accounts)
        except Exception:  # a database hiccup: the next sweep tries again
            log.exception("could not recover the responses of servers that are gone")


def _usage(input_tokens: int, cached: int, output: int) -> dict:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output,
    }
