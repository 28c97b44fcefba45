"""Open-loop arrival times: a Poisson process (exponential gaps) from a seeded RNG.

The schedule is fixed before the run and never waits for responses, so a slow server gets the
same offered load as a fast one and every latency is measured from its scheduled time.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator


def poisson_arrivals(rate: float, seed: int) -> Iterator[float]:
    """Arrival times in seconds, the first at 0; `rate` in requests/s. An infinite rate sends
    everything at time 0."""
    if rate <= 0:
        raise ValueError("the request rate must be positive")
    rng = random.Random(seed)
    t = 0.0
    while True:
        yield t
        if not math.isinf(rate):
            t += rng.expovariate(rate)
