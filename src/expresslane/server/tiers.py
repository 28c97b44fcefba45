"""`GET /v1/tiers`: what each service tier sells, so clients can read what they buy: its
names, whether this server serves it, its price, and its promise (promise.py) with what
happens when it is missed. A tier with an "auto" promise not measured yet says so."""

from __future__ import annotations

from fastapi import APIRouter, Request

from expresslane.lanes import ALIASES, LANE_NAMES
from expresslane.server.state import ServerState, get_state

router = APIRouter()


@router.get("/v1/tiers")
async def list_tiers(request: Request):
    state = get_state(request)
    return {"object": "list", "data": [_tier(state, name) for name in LANE_NAMES]}


def _tier(state: ServerState, name: str) -> dict:
    lane = state.engine.lanes[name]
    prices = state.accounts.prices
    m = lane.price_multiplier
    stated = state.engine.promises().get(name)
    promise = None
    if stated is not None:
        promise = stated.as_dict()
    elif lane.promise is not None and lane.enabled:
        promise = {"status": "measuring"}  # "auto", before the engine's calibration
    return {
        "id": name,
        "object": "service_tier",
        "aliases": sorted(alias for alias, lane in ALIASES.items() if lane == name),
        "served": lane.enabled,
        "price_multiplier": m,
        "prices_per_1m_tokens": {
            "input": prices.input_per_1m * m,
            "cached_input": prices.cached_input_per_1m * m,
            "output": prices.output_per_1m * m,
            "currency": prices.currency,
        },
        "promise": promise,
    }
