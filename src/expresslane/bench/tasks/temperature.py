"""Temperature conversions."""


def to_celsius(fahrenheit: float) -> float:
    """Degrees Fahrenheit in degrees Celsius."""
    return (fahrenheit - 32) * 9 / 5
