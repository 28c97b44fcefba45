"""Sums of integer ranges."""


def sum_range(a: int, b: int) -> int:
    """The sum of every integer from a to b, both included."""
    return sum(range(a, b))
