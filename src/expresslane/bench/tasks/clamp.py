"""Clamping a value into a range."""


def clamp(x: float, lo: float, hi: float) -> float:
    """x limited to the range [lo, hi]."""
    return min(lo, max(x, hi))
