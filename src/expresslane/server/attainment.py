"""How well each tier keeps its promise (promise.py), for `/metrics`: requests judged and
refunds per tier and key (counters), and over each promise's latest window the fraction kept
and the delivered speed at the promise's percentile (gauges). The ledger keeps every verdict
for `expresslane usage`."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

P = "expresslane:"
LABELS = ["model_name", "tier"]
GAUGES = {
    "promise_tokens_per_second": "The decode speed a tier promises per request, at its "
    "percentile per window",
    "promise_ttft_seconds": "The time to first token a tier promises",
    "promise_attainment": "Fraction of the tier's requests in the latest window that kept its "
    "promise",
    "promise_delivered_tokens_per_second": "Delivered decode speed at the promise's percentile "
    "in the latest window",
    "promise_window_requests": "Requests judged in the latest window",
}


@dataclass(frozen=True)
class Window:
    judged: int
    kept: int
    delivered_tokens_per_s: float | None  # at the promise's percentile; None without any

    @property
    def attainment(self) -> float:
        return self.kept / self.judged if self.judged else 1.0


class Attainment:
    """The requests judged per tier, kept for the latest window."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the event loop adds, a scrape reads
        # tier -> (time, kept, delivered tokens/s) of each request judged
        self._seen: dict[str, deque[tuple[float, bool, float | None]]] = {}

    def add(self, tier: str, kept: bool, delivered: float | None) -> None:
        with self._lock:
            self._seen.setdefault(tier, deque()).append((time.monotonic(), kept, delivered))

    def window(self, tier: str, seconds: float, percentile: float) -> Window:
        """The tier's requests judged in the last `seconds`."""
        edge = time.monotonic() - seconds
        with self._lock:
            seen = self._seen.get(tier, deque())
            while seen and seen[0][0] < edge:
                seen.popleft()
            rows = list(seen)
        speeds = [s for _, _, s in rows if s is not None]
        speed = float(np.percentile(speeds, percentile)) if speeds else None
        return Window(len(rows), sum(k for _, k, _ in rows), speed)


class PromiseMetrics:
    def __init__(self, registry: CollectorRegistry, engine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.requests = Counter(
            P + "promise_requests",
            "Requests judged against their tier's promise, by key and outcome (kept, missed)",
            LABELS + ["key", "outcome"],
            registry=registry,
        )
        self.refunds = Counter(
            P + "promise_refunds",
            "Refunded on requests that missed their tier's promise (in the prices' currency)",
            LABELS + ["key"],
            registry=registry,
        )
        self.attainment = Attainment()
        if engine is not None:
            registry.register(self)

    def observe(self, tier: str, key: str, row) -> None:
        """A finished request judged against its tier's promise (its ledger row)."""
        kept = bool(row.promise_kept)
        outcome = "kept" if kept else "missed"
        self.requests.labels(self.model_name, tier, key, outcome).inc()
        if row.refund:
            self.refunds.labels(self.model_name, tier, key).inc(row.refund)
        self.attainment.add(tier, kept, row.delivered_tokens_per_s)

    def collect(self):
        """Each promise and how it is kept over its latest window."""
        gauges = {
            name: GaugeMetricFamily(P + name, doc, labels=LABELS) for name, doc in GAUGES.items()
        }
        for tier, stated in self.engine.promises().items():
            labels = [self.model_name, tier]
            w = self.attainment.window(tier, stated.window_s, stated.percentile)
            gauges["promise_tokens_per_second"].add_metric(labels, stated.tokens_per_s)
            gauges["promise_ttft_seconds"].add_metric(labels, stated.ttft_s)
            gauges["promise_attainment"].add_metric(labels, w.attainment)
            gauges["promise_window_requests"].add_metric(labels, w.judged)
            if w.delivered_tokens_per_s is not None:
                gauges["promise_delivered_tokens_per_second"].add_metric(
                    labels, w.delivered_tokens_per_s
                )
        yield from gauges.values()
