"""A step-latency model: how long one engine step takes for a given batch.

    seconds ≈ a + b·sequences + c·tokens + d·(context tokens attended / 1024)

(one such line for steps of up to `small_tokens` tokens, those the C++ layer stack runs,
one for larger steps). The fixed part `a` is reading
the weights (at small batch a step is memory bound), `b` the per-sequence overhead, `c` the
per-token compute, `d` attention over the KV cache. The coefficients
are fitted, non-negative, to steps measured at startup (`LLMEngine.calibrate`) and then to the
steps the engine actually runs, so the model follows the device and its load. The scheduler uses
it to cap the lower lanes so that an ultrafast request keeps its tokens/s target.
"""

from __future__ import annotations

from collections import deque

import numpy as np

NUM_FEATURES = 4
# The solo step time is this percentile of the measured ones (`solo_step`)
SOLO_PERCENTILE = 25


def features(num_seqs: int, num_tokens: int, context_tokens: int) -> tuple[float, ...]:
    return (1.0, float(num_seqs), float(num_tokens), context_tokens / 1024.0)


def _fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: refit without the most negative one until
    none is (at most one solve per feature; cheap enough to run between two steps)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        del active[int(np.argmin(sol))]
    return coef


def _medians(
    points: list[tuple[tuple[float, ...], float]],
) -> list[tuple[tuple[float, ...], float]]:
    """One point per step shape: the median of its times (calibration repeats each shape)."""
    times: dict[tuple[float, ...], list[float]] = {}
    for x, y in points:
        times.setdefault(x, []).append(y)
    return [(x, float(np.median(ys))) for x, ys in times.items()]


class _Fit:
    def __init__(self, window: int):
        self.calibration: list[tuple[tuple[float, ...], float]] = []
        self.recent: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self.coef: np.ndarray | None = None

    def fit(self) -> None:
        # Calibration points keep the fit well-posed when live traffic covers only a few
        # batch shapes; live points outnumber them and follow the device's current speed.
        points = _medians(self.calibration) + list(self.recent)
        if len(points) >= 2:
            x = np.array([p[0] for p in points])
            self.coef = _fit_nonnegative(x, np.array([p[1] for p in points]))


class StepLatencyModel:
    """Two fits: steps of at most `small_tokens` tokens run other kernels (the small-batch
    linear, the fused decode step) than larger ones, so each regime has its own line."""

    def __init__(self, window: int = 256, refit_every: int = 64, small_tokens: int = 8):
        self.small_tokens = small_tokens
        self.fits = {"small": _Fit(window), "large": _Fit(window)}
        self.refit_every = refit_every
        self._since_fit = 0
        self.solo_steps: deque[float] = deque(maxlen=window)  # one sequence, one token
        self.calibrating = False  # steps timed now go to the calibration set (calibration.py)

    def _regime(self, num_tokens: int) -> str:
        return "small" if num_tokens <= self.small_tokens else "large"

    @property
    def ready(self) -> bool:
        return any(f.coef is not None for f in self.fits.values())

    @property
    def calibration(self) -> list:
        return [p for f in self.fits.values() for p in f.calibration]

    def record(self, num_seqs: int, num_tokens: int, context_tokens: int, seconds: float):
        """A step's time: into the calibration set while calibrating, else observed live."""
        if self.calibrating:
            self.add_calibration(num_seqs, num_tokens, context_tokens, seconds)
        else:
            self.observe(num_seqs, num_tokens, context_tokens, seconds)

    def observe(self, num_seqs: int, num_tokens: int, context_tokens: int, seconds: float):
        point = (features(num_seqs, num_tokens, context_tokens), seconds)
        self.fits[self._regime(num_tokens)].recent.append(point)
        if num_seqs == num_tokens == 1:
            self.solo_steps.append(seconds)
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self.fit()

    def add_calibration(self, num_seqs: int, num_tokens: int, context_tokens: int, seconds):
        point = (features(num_seqs, num_tokens, context_tokens), seconds)
        self.fits[self._regime(num_tokens)].calibration.append(point)
        if num_seqs == num_tokens == 1:
            self.solo_steps.append(seconds)

    def solo_step(self) -> float | None:
        """The time of a single-token step of one sequence (a decode alone), measured rather
        than predicted: the faster quarter of the latest ones (a busy machine only slows
        steps, so this follows the machine more than its load); None before any. Safe from
        another thread (the metrics): the deque is copied in one C call first."""
        steps = list(self.solo_steps)
        return float(np.percentile(steps, SOLO_PERCENTILE)) if steps else None

    def export(self) -> dict:
        """The calibration's step times, as `restore` takes them back (calibration_cache.py)."""
        fits = {name: [[*x, y] for x, y in f.calibration] for name, f in self.fits.items()}
        return {**fits, "solo": list(self.solo_steps)}

    def restore(self, steps: dict) -> None:
        """Take a kept calibration's step times as if just measured, and fit them."""
        points = {
            name: [(tuple(map(float, p[:-1])), float(p[-1])) for p in steps[name]]
            for name in self.fits
        }
        solo = [float(s) for s in steps["solo"]]
        if any(len(x) != NUM_FEATURES for kept in points.values() for x, _ in kept):
            raise ValueError("a kept step has the wrong number of features")
        for name, f in self.fits.items():
            f.calibration = points[name]
        self.solo_steps.extend(solo)
        self.fit()

    def forget_live(self) -> None:
        """Drop the live steps seen so far (a calibration's warm-up)."""
        for f in self.fits.values():
            f.recent.clear()
        self.solo_steps.clear()
        self._since_fit = 0

    def fit(self) -> None:
        self._since_fit = 0
        for f in self.fits.values():
            f.fit()

    def set_costs(self, coef) -> None:
        """Use these coefficients for every batch (tests, or a model measured elsewhere)."""
        for f in self.fits.values():
            f.coef = np.asarray(coef, dtype=float)

    def predict(self, num_seqs: int, num_tokens: int, context_tokens: int) -> float:
        if not self.ready:
            return 0.0
        coef = self._coef(self._regime(num_tokens))
        return float(np.dot(coef, features(num_seqs, num_tokens, context_tokens)))

    def most_tokens(
        self, num_seqs: int, num_tokens: int, context_tokens: int, n: int, limit: float
    ) -> int:
        """The most k <= n more tokens (each attending one more position) that keep
        `predict(num_seqs, num_tokens + k, context_tokens + k)` within `limit`: solved on each
        regime's line in plain floats (the scheduler asks this for every capped request)."""
        if not self.ready:
            return n
        best, edge = 0, self.small_tokens - num_tokens  # k <= edge: the small line
        for name, lo, hi in (("small", 0, min(n, edge)), ("large", max(0, edge + 1), n)):
            if hi < lo:
                continue
            a, b, c, d = self._coef(name).tolist()
            fixed = a + b * num_seqs + c * num_tokens + d * context_tokens / 1024.0
            slope = c + d / 1024.0  # >= 0: the coefficients are
            if fixed + slope * lo > limit:
                continue
            k = hi if slope <= 0 else min(hi, int((limit - fixed) / slope))
            best = max(best, k)
        return best

    def cost_line(self, num_seqs: int, context_tokens: int):
        """`predict` as a function of the step's tokens for a fixed batch and context (None
        before any fit); plain floats, cheap enough to call for every guess considered."""
        if not self.ready:
            return None
        lines = {}
        for name in self.fits:
            a, b, c, d = self._coef(name).tolist()
            lines[name] = (a + b * num_seqs + d * context_tokens / 1024.0, c)
        small, large, limit = lines["small"], lines["large"], self.small_tokens

        def seconds(num_tokens: int) -> float:
            fixed, per_token = small if num_tokens <= limit else large
            return fixed + per_token * num_tokens

        return seconds

    def _coef(self, regime: str):
        fit = self.fits[regime]
        if fit.coef is None:  # not fitted yet: the other regime's line stands in
            fit = next(f for f in self.fits.values() if f.coef is not None)
        return fit.coef

    def describe(self) -> str:
        parts = []
        for name, f in self.fits.items():
            if f.coef is not None:
                a, b, c, d = (1000 * v for v in f.coef)
                parts.append(
                    f"{name} steps: {a:.2f} ms + {b:.3f} ms/seq + {c:.4f} ms/token + "
                    f"{d:.3f} ms per 1k context tokens"
                )
        return "; ".join(parts) or "not calibrated"
