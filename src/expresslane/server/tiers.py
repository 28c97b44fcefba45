"""Service tiers as the API names them, and the lane that serves each.

Canonical tiers are the lanes `ultrafast`, `default` and `flex` (see `lanes.py`); `priority` and
`fast` are aliases of `ultrafast`, `standard` and `scale` of `default`, and `auto` (or no tier)
means the caller's default tier, which the API key's plan sets.
"""

from __future__ import annotations

from typing import Literal

TierName = Literal["auto", "default", "flex", "ultrafast", "priority", "fast", "standard", "scale"]

ALIASES = {
    "priority": "ultrafast",
    "fast": "ultrafast",
    "standard": "default",
    "scale": "default",
}


def canonical_tier(name: str | None, default_tier: str = "default") -> str:
    if name is None or name == "auto":
        return default_tier
    return ALIASES.get(name, name)
