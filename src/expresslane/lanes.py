"""Lanes: how each service tier is scheduled and priced.

One model serves three lanes. A lane's `rank` is its scheduling priority: lower ranks are
scheduled first (the vLLM convention), so `ultrafast` (0) runs before `default` (1) and `flex` (2).
While an ultrafast request is active, the lower lanes only get the part of each step that keeps
it at its target (see `engine/scheduler.py`): by default ("auto") `solo_fraction` of the speed
it gets alone; `flex` only gets what `default` leaves and is preempted first. Lanes are
configured in the `[lanes.NAME]` tables of the config file.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from expresslane.errors import InvalidRequestError

LANE_NAMES = ("ultrafast", "default", "flex")


@dataclass(frozen=True)
class Lane:
    name: str
    rank: int
    max_batch: int  # requests of this lane running at once; more wait in its queue
    price_multiplier: float = 1.0  # times the base per-token prices
    preemptible: bool = False  # may lose its KV blocks to a better-ranked request
    # Per-request decode speed this lane is held at by capping the lower lanes; None: no
    # target; "auto": `solo_fraction` of the speed its requests get alone.
    target_tokens_per_s: float | str | None = None
    # With "auto": the lower lanes add 1/solo_fraction - 1 to this lane's step time, on average.
    solo_fraction: float = 0.95
    # Overrides the engine's `speculative` for this lane; False: no speculation here.
    speculative: dict | bool | None = None
    enabled: bool = True


DEFAULT_LANES = {
    "ultrafast": Lane(
        "ultrafast",
        0,
        max_batch=4,
        price_multiplier=6.0,
        target_tokens_per_s="auto",
        speculative={"method": "ngram", "num_tokens": 12},
    ),
    "default": Lane("default", 1, max_batch=64, price_multiplier=1.0),
    "flex": Lane("flex", 2, max_batch=64, price_multiplier=0.5, preemptible=True),
}


def build_lanes(overrides: dict | None) -> dict[str, Lane]:
    """The default lanes updated by `{lane name: {field: value}}` (the `[lanes.*]` tables)."""
    lanes = dict(DEFAULT_LANES)
    known = {f.name for f in fields(Lane)} - {"name", "rank"}
    for name, values in (overrides or {}).items():
        if name not in lanes:
            raise InvalidRequestError(f"unknown lane {name!r}; lanes are {list(LANE_NAMES)}")
        if isinstance(values, Lane):
            lanes[name] = values
            continue
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown setting(s) {unknown} for lane {name!r}; known: {sorted(known)}"
            )
        lanes[name] = replace(lanes[name], **values)
    for lane in lanes.values():
        target = lane.target_tokens_per_s
        if lane.max_batch < 1:
            raise InvalidRequestError(f"lane {lane.name!r}: max_batch must be at least 1")
        if not (isinstance(lane.solo_fraction, (int, float)) and 0 < lane.solo_fraction <= 1):
            raise InvalidRequestError(f"lane {lane.name!r}: solo_fraction must be in (0, 1]")
        if (
            target is not None
            and target != "auto"
            and not (isinstance(target, (int, float)) and target > 0)
        ):
            raise InvalidRequestError(
                f"lane {lane.name!r}: target_tokens_per_s must be a positive number, "
                f'"auto" or unset'
            )
    if not lanes["default"].enabled:
        raise InvalidRequestError("the default lane cannot be disabled")
    return lanes
