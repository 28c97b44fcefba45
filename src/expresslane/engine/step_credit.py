"""The step time the lanes below a relatively targeted lane may add (scheduler.py).

A lane held at a fraction f of its solo speed lets the lower lanes add 1/f - 1 of the time its
own rows take in a step, on average. Each such step adds that share to a balance (up to one
step's time: a row that costs more than one step's share still runs every few steps); the lower
lanes' rows are scheduled while their predicted cost fits in it and are charged what they cost.

What they cost is predicted by the step-latency model, and then measured: a step's time beyond
what the targeted rows take alone (their predicted time scaled by the measured/predicted ratio
of recent steps that ran only targeted rows). The larger of the two is charged, so a model that
underestimates the lower rows (a linear fit over every batch shape, the sampler's and the
output's per-row work) does not let them take more than their share; the balance may go into
debt (at most one step's time) that later steps pay back.
"""

from __future__ import annotations

import statistics
from collections import deque

# Steps of targeted rows only whose measured/predicted time ratio scales the prediction
PACE_WINDOW = 32


class StepCredit:
    def __init__(self) -> None:
        self.balance = 0.0  # seconds the lower lanes may still add
        self._base: float | None = None  # predicted seconds of this step's targeted rows
        # (base, charged: None without lower rows) of the step that ran
        self._ran: tuple[float, float | None] | None = None
        self._paces: deque[float] = deque(maxlen=PACE_WINDOW)

    def open(self, targeted_seconds: float, fraction: float) -> float:
        """A step whose targeted rows take `targeted_seconds` (predicted): the step time the
        lower lanes may fill it up to."""
        share = targeted_seconds * (1 / fraction - 1)
        self.balance = min(self.balance + share, targeted_seconds)
        self._base = targeted_seconds
        return targeted_seconds + self.balance

    def close(self, step_seconds: float, lower_rows: bool) -> None:
        """The step as scheduled takes `step_seconds` (predicted), with or without rows of the
        lower lanes: charge their part. Nothing is kept over a step without a relative
        target."""
        base, self._base = self._base, None
        self._ran = None
        if base is None:
            self.balance = 0.0
            return
        charged = step_seconds - base if lower_rows else None
        self.balance -= charged or 0.0
        self._ran = (base, charged)

    def settle(self, seconds: float) -> None:
        """The step ran in `seconds`: charge what the lower rows measured beyond their
        prediction, or learn the pace of the targeted rows alone (until then, the
        prediction's)."""
        ran, self._ran = self._ran, None
        if ran is None or ran[0] <= 0:
            return
        base, charged = ran
        if charged is None:
            self._paces.append(seconds / base)
            return
        pace = statistics.median(self._paces) if self._paces else 1.0
        measured = seconds - base * pace
        self.balance = max(self.balance - max(0.0, measured - charged), -base)
