"""The tiers' promises as the client sees them: each served tier's published promise (an
expresslane server's `GET /v1/tiers`; other endpoints publish none) against the speed and
time to first token measured here, with the server's own rule (`promise.Stated.judge`).
Client-side TTFT counts the network and the client's queue, so it is the stricter view."""

from __future__ import annotations

from typing import Any

import httpx

from expresslane.bench.metrics import output_tokens, stats, tokens_per_s, ttft
from expresslane.bench.records import RequestRecord
from expresslane.bench.target import Target
from expresslane.promise import Stated


def published(target: Target) -> dict[str, dict]:
    """Each tier's published promise ({} where the endpoint publishes none)."""
    try:
        r = httpx.get(target.url("tiers"), headers=target.headers(), timeout=10)
        tiers = r.json()["data"] if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return {}
    return {
        t["id"]: t["promise"]
        for t in tiers
        if isinstance(t, dict)
        and isinstance(t.get("promise"), dict)
        and "tokens_per_s" in t["promise"]
    }


def _stated(p: dict) -> Stated:
    return Stated(
        tokens_per_s=p["tokens_per_s"],
        ttft_s=p["ttft_s"],
        prompt_tokens=p["ttft_prompt_tokens"],
        floor_fraction=p["floor_tokens_per_s"] / p["tokens_per_s"],
        min_output_tokens=p.get("speed_judged_from_output_tokens", 2),
        percentile=p["percentile"],
        window_s=p["window_s"],
    )


def judge_tiers(records: list[RequestRecord], promises: dict[str, dict]) -> dict[str, Any]:
    """Per served tier with a promise: promised and delivered speed, and how many of its
    requests kept the promise."""
    out: dict[str, Any] = {}
    for tier, p in sorted(promises.items()):
        mine = [r for r in records if r.ok and r.served_tier == tier]
        if not mine:
            continue
        stated = _stated(p)
        kept = sum(_kept(stated, r) for r in mine)
        out[tier] = {
            "promised_tokens_per_s": stated.tokens_per_s,
            "floor_tokens_per_s": stated.floor_tokens_per_s,
            "promised_ttft_s": stated.ttft_s,
            "delivered_tokens_per_s": stats(tokens_per_s(r) for r in mine),
            "ttft": stats(ttft(r) for r in mine),
            "requests": len(mine),
            "kept": kept,
            "attainment": kept / len(mine),
        }
    return out


def _kept(stated: Stated, r: RequestRecord) -> bool:
    decode = None if r.end is None or r.first_token is None else r.end - r.first_token
    return stated.judge(r.input_tokens or 0, output_tokens(r), ttft(r), decode).kept
