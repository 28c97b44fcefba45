"""Service tiers as the API names them, and the lane rank each is scheduled with.

Canonical tiers are `ultrafast`, `default` and `flex`; `priority` and `fast` are aliases of
`ultrafast`, `standard` of `default`, and `auto` means the caller's default tier (`default` for
now). A lane's rank is the engine's `priority`: lower is scheduled first (the vLLM convention).
"""

from __future__ import annotations

from typing import Literal

TierName = Literal["auto", "default", "flex", "ultrafast", "priority", "fast", "standard", "scale"]

ALIASES = {
    "priority": "ultrafast",
    "fast": "ultrafast",
    "standard": "default",
    "auto": "default",
    "scale": "default",
}
RANKS = {"ultrafast": 0, "default": 1, "flex": 2}


def canonical_tier(name: str | None) -> str:
    name = name or "auto"
    return ALIASES.get(name, name)


def lane_rank(tier: str) -> int:
    return RANKS[canonical_tier(tier)]
