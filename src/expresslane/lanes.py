"""Lanes, the one owner of service tiers: their names and the API's aliases for them, each
lane's settings (batch, price, target, speculation), which lanes are served, their capacity,
the downgrade policy, and the count of requests in flight per lane.

Names: the API says `service_tier`, everything past admission says `lane`; `lane_for` is the
one mapping (a canonical tier's name is its lane's name, which the API echoes as the tier
that served a request).

One model serves three lanes. A lane's `rank` is its scheduling priority: lower ranks are
scheduled first (the vLLM convention), so `ultrafast` (0) runs before `default` (1) and `flex` (2).
While an ultrafast request is active, the lower lanes only get the part of each step that keeps
it at its target (see `engine/scheduler.py`): by default ("auto") `solo_fraction` of the speed
it gets alone; `flex` only gets what `default` leaves and is preempted first. Lanes are
configured in the `[lanes.NAME]` tables of the config file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from typing import Literal, Protocol

from expresslane.errors import InvalidRequestError
from expresslane.promise import Promise

LANE_NAMES = ("ultrafast", "default", "flex")

# What a request's `service_tier` may say: a lane's name, an alias of one, or `auto` (or no
# tier): the caller's default, which the API key's plan sets.
TierName = Literal["auto", "default", "flex", "ultrafast", "priority", "fast", "standard", "scale"]
ALIASES = {
    "priority": "ultrafast",
    "fast": "ultrafast",
    "standard": "default",
    "scale": "default",
}


def lane_for(service_tier: str | None, default_lane: str = "default") -> str:
    """The lane a `service_tier` names (`default_lane` for `auto` or none)."""
    if service_tier is None or service_tier == "auto":
        return default_lane
    return ALIASES.get(service_tier, service_tier)


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
    # The speed its requests are sold (promise.py): checked at admission, per request, billed.
    promise: Promise | None = None
    # The most of this lane one API key may hold, when a server has keys: this fraction of its
    # queue at admission, and of its running slots (engine/tenant_shares.py).
    key_share: float = 1.0


DEFAULT_LANES = {
    "ultrafast": Lane(
        "ultrafast",
        0,
        max_batch=4,
        price_multiplier=6.0,
        target_tokens_per_s="auto",
        speculative={"method": "suffix", "num_tokens": 12},
        promise=Promise(),
        key_share=0.5,
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
        if "promise" in values:
            values = {**values, "promise": Promise.from_table(name, values["promise"])}
        elif values.get("target_tokens_per_s", "") is None:
            values = {**values, "promise": None}  # nothing keeps the default promise then
        lanes[name] = replace(lanes[name], **values)
    for lane in lanes.values():
        target = lane.target_tokens_per_s
        if lane.max_batch < 1:
            raise InvalidRequestError(f"lane {lane.name!r}: max_batch must be at least 1")
        if not (isinstance(lane.solo_fraction, (int, float)) and 0 < lane.solo_fraction <= 1):
            raise InvalidRequestError(f"lane {lane.name!r}: solo_fraction must be in (0, 1]")
        if not (isinstance(lane.key_share, (int, float)) and 0 < lane.key_share <= 1):
            raise InvalidRequestError(f"lane {lane.name!r}: key_share must be in (0, 1]")
        if (
            target is not None
            and target != "auto"
            and not (isinstance(target, (int, float)) and target > 0)
        ):
            raise InvalidRequestError(
                f"lane {lane.name!r}: target_tokens_per_s must be a positive number, "
                f'"auto" or unset'
            )
        if lane.promise is not None and target is None:
            raise InvalidRequestError(
                f"lane {lane.name!r}: a promise needs a target_tokens_per_s (the scheduler "
                "keeps the promise by holding the lower lanes to the target)"
            )
    if not lanes["default"].enabled:
        raise InvalidRequestError("the default lane cannot be disabled")
    return lanes


def served(lanes: dict[str, Lane]) -> list[str]:
    """The lanes served here (enabled), best rank first."""
    return [la.name for la in sorted(lanes.values(), key=lambda la: la.rank) if la.enabled]


def is_served(lanes: dict[str, Lane], name: str) -> bool:
    lane = lanes.get(name)
    return lane is not None and lane.enabled


def queue_capacity(lane: Lane, queued: int | None = None) -> int:
    """Requests of a lane that may be running or waiting: its max batch plus `queued`
    waiting (None: as many again as its max batch)."""
    return lane.max_batch + (lane.max_batch if queued is None else queued)


# -- the downgrade policy --------------------------------------------------------------------

WhenUnavailable = Literal["queue", "downgrade", "reject"]


class Entitlement(Protocol):
    """What a caller may use (an API key's plan, server/keys.py)."""

    tiers: list[str]  # the lanes it may use
    default_tier: str  # its lane for `auto`
    when_unavailable: str  # a `WhenUnavailable`


@dataclass(frozen=True)
class Placement:
    """Where a request goes: `lane`, or refused for a `refusal` ("not_served": no such lane
    here; "not_allowed": the caller may not use it; "at_capacity": full, no lane to go to)."""

    asked: str
    lane: str | None = None
    refusal: str | None = None
    queued: bool = False  # placed by the `queue` policy on a lane without room


def place(
    lanes: dict[str, Lane], asked: str, who: Entitlement, room: Callable[[str], bool]
) -> Placement:
    """The lane that serves a request that asked for the lane `asked`. A lane the caller may
    not use is refused, or with `downgrade` its default lane serves; a lane without `room`
    for it (its max batch reached, or its promise at stake: `engine/lane_room.py`) queues it,
    or (`downgrade`) sends it to the next lane down the caller may use, or (`reject`)
    refuses it."""
    if not is_served(lanes, asked):
        return Placement(asked, refusal="not_served")
    if asked not in who.tiers:
        if who.when_unavailable != "downgrade":
            return Placement(asked, refusal="not_allowed")
        return Placement(asked, who.default_tier)
    lane = lanes[asked]
    has_room = room(asked)
    if who.when_unavailable == "queue" or has_room:
        return Placement(asked, asked, queued=not has_room)
    lower = [
        la for la in lanes.values() if la.rank > lane.rank and la.enabled and la.name in who.tiers
    ]
    if who.when_unavailable == "reject" or not lower:
        return Placement(asked, refusal="at_capacity")
    return Placement(asked, min(lower, key=lambda la: la.rank).name)


# -- requests per lane -----------------------------------------------------------------------


class LaneCounts:
    """Requests in flight per lane (an engine's, a fleet ingress's)."""

    def __init__(self, lanes: Iterable[str] = ()):
        self._counts: dict[str, int] = dict.fromkeys(lanes, 0)

    @classmethod
    def of(cls, lanes: Iterable[str]) -> LaneCounts:
        """The count of each lane named in `lanes` (one name per request)."""
        counts = cls()
        for lane in lanes:
            counts.add(lane)
        return counts

    def add(self, lane: str) -> None:
        self._counts[lane] = self._counts.get(lane, 0) + 1

    def done(self, lane: str) -> None:
        self._counts[lane] -= 1

    def __call__(self, lane: str) -> int:
        return self._counts.get(lane, 0)

    def as_dict(self) -> dict[str, int]:
        return dict(self._counts)
