"""Metrics from request records: per-request latencies, run throughput, goodput under SLOs.

All times are seconds, measured by the client; `DEFINITIONS` is the text the report carries.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np

from expresslane.bench.records import RequestRecord

DEFINITIONS = """\
All times are measured by the benchmark client, in seconds from when the load model scheduled
the request (open loop: its Poisson arrival time; closed loop: when a worker was free), so time
the client spent late, waiting to connect or retrying counts (no coordinated omission).

- **TTFT** = first output chunk received − scheduled.
- **E2E** = last byte of the response received − scheduled.
- **Queue (client)** = request sent − scheduled (time the client itself was behind).
- **TPOT** = (E2E − TTFT) / (output tokens − 1), per request, only when output tokens > 1.
- **ITL** = every gap between consecutive streamed output chunks, pooled over all requests. With
  speculative decoding one chunk can carry several tokens, so ITL can exceed TPOT.
- **Per-request tokens/s** = (output tokens − 1) / (E2E − TTFT): the speed one user sees.
  TPOT and tokens/s need more than one output chunk: an answer that arrives whole (a tool call
  a server holds back until it is complete) has neither, and its TTFT holds its decode time.
- **Request throughput** = completed requests / run wall time; **output throughput** = output
  tokens of completed requests / run wall time. Wall time runs from the start of the run to the
  end of its last request.
- **Goodput** = completed requests meeting every SLO given (`--slo ttft=…,tpot=…,e2e=…`) / run
  wall time; a request with one output token passes the TPOT SLO. **SLO attainment** = those
  requests / all requests (failed ones count as missing).
- Token counts come from the server's `usage`; if a server reports none, output tokens are
  the number of streamed chunks.
- Failed requests (HTTP errors, error events, broken streams) are counted as errors and left out
  of the latency statistics; retries are counted per request.
- Percentiles are numpy's (linear interpolation).
"""

SLO_KEYS = ("ttft", "tpot", "e2e")
LATENCIES = ("ttft", "tpot", "itl", "e2e", "queue", "per_request_tokens_per_s")


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=0.5,tpot=0.05,e2e=10' -> {'ttft': 0.5, 'tpot': 0.05, 'e2e': 10.0} (seconds)."""
    slo: dict[str, float] = {}
    for part in filter(None, (text or "").split(",")):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in SLO_KEYS:
            raise ValueError(f"--slo {text!r}: expected NAME=SECONDS with NAME in {SLO_KEYS}")
        slo[name] = float(value)
    return slo


def output_tokens(r: RequestRecord) -> int:
    return r.output_tokens if r.output_tokens is not None else len(r.chunk_times)


def ttft(r: RequestRecord) -> float | None:
    return None if r.first_token is None else r.first_token - r.scheduled


def e2e(r: RequestRecord) -> float | None:
    return None if r.end is None else r.end - r.scheduled


def queue(r: RequestRecord) -> float | None:
    return None if r.sent is None else r.sent - r.scheduled


def streamed(r: RequestRecord) -> bool:
    """More than one output chunk arrived, so there is a decode time to divide."""
    return len(r.chunk_times) > 1


def tpot(r: RequestRecord) -> float | None:
    n = output_tokens(r)
    if n <= 1 or r.first_token is None or r.end is None or not streamed(r):
        return None
    return (r.end - r.first_token) / (n - 1)


def tokens_per_s(r: RequestRecord) -> float | None:
    n = output_tokens(r)
    if n <= 1 or r.first_token is None or r.end is None or r.end <= r.first_token:
        return None
    return (n - 1) / (r.end - r.first_token) if streamed(r) else None


def itls(r: RequestRecord) -> list[float]:
    return list(np.diff(r.chunk_times)) if len(r.chunk_times) > 1 else []


def stats(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """count, mean, min, p50, p90, p99, max of the values that are not None."""
    xs = np.array([v for v in values if v is not None], dtype=float)
    if xs.size == 0:
        return {
            "count": 0,
            "mean": None,
            "min": None,
            "p50": None,
            "p90": None,
            "p99": None,
            "max": None,
        }
    p50, p90, p99 = np.percentile(xs, [50, 90, 99])
    return {
        "count": int(xs.size),
        "mean": float(xs.mean()),
        "min": float(xs.min()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(xs.max()),
    }


def meets_slo(r: RequestRecord, slo: dict[str, float]) -> bool:
    if not r.ok:
        return False
    checks = {"ttft": ttft(r), "tpot": tpot(r), "e2e": e2e(r)}
    for name, limit in slo.items():
        value = checks[name]
        if value is None:
            if name == "tpot":
                continue  # one output token: no time per output token to miss
            return False
        if value > limit:
            return False
    return True


def latency_stats(records: list[RequestRecord]) -> dict[str, Any]:
    return {
        "ttft": stats(ttft(r) for r in records),
        "tpot": stats(tpot(r) for r in records),
        "itl": stats(x for r in records for x in itls(r)),
        "e2e": stats(e2e(r) for r in records),
        "queue": stats(queue(r) for r in records),
        "per_request_tokens_per_s": stats(tokens_per_s(r) for r in records),
    }


def summarize(
    records: list[RequestRecord], duration_s: float, slo: dict[str, float] | None = None
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    per_s = lambda n: n / duration_s if duration_s > 0 else None
    out_tokens = sum(output_tokens(r) for r in ok)
    in_tokens = sum(r.input_tokens or 0 for r in ok)
    good = sum(meets_slo(r, slo) for r in records) if slo else None
    errors = Counter(r.error for r in records if not r.ok)
    tiers = _groups(ok, lambda r: r.served_tier)
    pools = _groups(ok, lambda r: r.pool and f"{r.pool}/{r.served_tier or '?'}")
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "error_messages": dict(errors.most_common(10)),
        "retries": sum(r.retries for r in records),
        "duration_s": duration_s,
        "input_tokens": in_tokens,
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "slo": slo or None,
        "goodput": None if good is None else per_s(good),
        "slo_attainment": None if good is None or not records else good / len(records),
        **latency_stats(ok),
        "tiers": tiers,
        "pools": pools,  # a fleet's pool/tier pairs, from the response headers
    }


def _groups(ok: list[RequestRecord], key) -> dict[str, Any]:
    """Latency and speed of the records grouped by `key(record)` (None: left out)."""
    out: dict[str, Any] = {}
    for name in sorted({key(r) for r in ok if key(r)}):
        mine = [r for r in ok if key(r) == name]
        out[name] = {
            "requests": len(mine),
            "ttft": stats(ttft(r) for r in mine),
            "e2e": stats(e2e(r) for r in mine),
            "per_request_tokens_per_s": stats(tokens_per_s(r) for r in mine),
        }
    return out
