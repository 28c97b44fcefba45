"""When a failed attempt is retried, and how long to wait first.

Retried: HTTP 408, 409, 429 and 5xx (as the openai SDK does), unless the server says
`x-should-retry: false` (e.g. an exhausted quota). The wait is the server's `retry-after-ms`
or `Retry-After` (seconds) when given and sane, else exponential backoff from 0.5 s.
"""

from __future__ import annotations

from collections.abc import Mapping

MAX_WAIT_S = 60.0


def should_retry(status: int | None, headers: Mapping[str, str] | None = None) -> bool:
    if headers is not None and headers.get("x-should-retry", "").lower() == "false":
        return False
    return status is not None and (status in (408, 409, 429) or status >= 500)


def retry_wait(attempt: int, headers: Mapping[str, str] | None = None) -> float:
    """Seconds to wait before retry number `attempt` (1-based)."""
    if headers is not None:
        for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
            value = headers.get(name)
            if value is None:
                continue
            try:
                wait = float(value) * scale
            except ValueError:
                continue  # an HTTP date: fall back to backoff
            if 0 <= wait <= MAX_WAIT_S:
                return wait
    return min(0.5 * 2 ** (attempt - 1), 8.0)
