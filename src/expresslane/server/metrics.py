"""Prometheus metrics, named as vLLM names them with an `expresslane:` prefix and a `tier` label.

Times are server-side, measured from the moment the server received the request:
TTFT = received -> first output token ready to send; TPOT (per request) = (e2e - TTFT) /
(output tokens - 1); ITL = gaps between successive token batches; queue time = engine arrival
-> first scheduled. Load gauges (running/waiting requests, KV blocks) are read from the engine
at scrape time.

Counters by API key (promise outcomes, refunds: `attainment.py`) show every tenant's use: a
scrape sees them per key only with an operator key (or `[server] metrics_per_key = true`);
otherwise they are summed over keys, without the `key` label.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from expresslane.engine.output import RequestOutput
from expresslane.lanes import LANE_NAMES
from expresslane.server.attainment import PromiseMetrics

P = "expresslane:"
LABELS = ["model_name", "tier"]

TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
]
TPOT_BUCKETS = [
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
]
E2E_BUCKETS = [
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
]


class _EngineCollector:
    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        snap = self.engine.snapshot()
        for name, counts, doc in (
            ("num_requests_running", snap.running, "Requests in the running batch"),
            ("num_requests_waiting", snap.waiting, "Requests waiting to run"),
        ):
            g = GaugeMetricFamily(P + name, doc, labels=LABELS)
            for tier, n in {**dict.fromkeys(LANE_NAMES, 0), **counts}.items():
                g.add_metric([self.model_name, tier], n)
            yield g
        g = GaugeMetricFamily(
            P + "lane_target_tokens_per_second",
            "Per-request decode speed a lane is held at (lower lanes are capped to keep it)",
            labels=LABELS,
        )
        for lane, target in snap.targets.items():
            g.add_metric([self.model_name, lane], target)
        yield g
        for name, field, doc in (
            ("spec_decode_num_drafts", "steps", "Verification passes that checked guesses"),
            ("spec_decode_num_draft_tokens", "proposed", "Speculative tokens proposed"),
            ("spec_decode_num_accepted_tokens", "accepted", "Speculative tokens accepted"),
        ):
            c = CounterMetricFamily(P + name, doc, labels=LABELS)
            for lane, counts in snap.spec.items():
                c.add_metric([self.model_name, lane], getattr(counts, field))
            yield c
        if snap.routed:
            c = CounterMetricFamily(
                P + "fleet_requests_routed",
                "Requests this ingress sent to each pool and replica",
                labels=["model_name", "pool", "replica", "tier"],
            )
            for (pool, replica, tier), n in snap.routed.items():
                c.add_metric([self.model_name, pool, replica, tier], n)
            yield c
        used, total = snap.kv_used_blocks, snap.kv_total_blocks
        for name, value, doc in (
            ("kv_cache_used_blocks", used, "KV cache blocks held by requests"),
            ("kv_cache_total_blocks", total, "KV cache blocks in the pool"),
            ("kv_cache_usage_perc", used / total if total else 0.0, "Fraction of KV blocks used"),
        ):
            g = GaugeMetricFamily(P + name, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            yield g


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = self._histogram(
            "time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS
        )
        self.tpot = self._histogram(
            "request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            TPOT_BUCKETS,
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds", "Gaps between streamed tokens", TPOT_BUCKETS
        )
        self._itl_by_tier: dict = {}
        self.e2e = self._histogram(
            "e2e_request_latency_seconds", "End-to-end request latency", E2E_BUCKETS
        )
        self.queue = self._histogram(
            "request_queue_time_seconds", "Time waiting to be scheduled", E2E_BUCKETS
        )
        self.prompt_tokens = Counter(
            P + "prompt_tokens", "Prompt tokens processed", LABELS, registry=r
        )
        self.cached_tokens = Counter(
            P + "cached_prompt_tokens",
            "Prompt tokens served from the prefix cache",
            LABELS,
            registry=r,
        )
        self.generation_tokens = Counter(
            P + "generation_tokens", "Tokens generated", LABELS, registry=r
        )
        self.requests = Counter(
            P + "request_success",
            "Finished requests by finish reason",
            LABELS + ["finished_reason"],
            registry=r,
        )
        self.promises = PromiseMetrics(r, engine, model_name)
        if engine is not None:
            r.register(_EngineCollector(engine, model_name))

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram(P + name, doc, LABELS, buckets=buckets, registry=self.registry)

    def observe_gap(self, tier: str, seconds: float, tokens: int) -> None:
        h = self._itl_by_tier.get(tier)  # `labels` per streamed output cost more than observing
        if h is None:
            h = self._itl_by_tier[tier] = self.itl.labels(self.model_name, tier)
        for _ in range(max(tokens, 1)):
            h.observe(seconds / max(tokens, 1))

    def observe_aborted(self, tier: str, last: RequestOutput | None) -> None:
        """A request stopped early (client gone, cancelled): count what it used so far."""
        labels = (self.model_name, tier)
        self.requests.labels(*labels, "abort").inc()
        if last is not None:
            self.prompt_tokens.labels(*labels).inc(last.num_prompt_tokens)
            self.cached_tokens.labels(*labels).inc(last.num_cached_tokens)
            self.generation_tokens.labels(*labels).inc(last.num_output_tokens)

    def observe_finished(
        self,
        tier: str,
        received: float,
        first_token: float | None,
        finished: float,
        out: RequestOutput,
    ) -> None:
        labels = (self.model_name, tier)
        self.requests.labels(*labels, out.finish_reason or "unknown").inc()
        self.prompt_tokens.labels(*labels).inc(out.num_prompt_tokens)
        self.cached_tokens.labels(*labels).inc(out.num_cached_tokens)
        self.generation_tokens.labels(*labels).inc(out.num_output_tokens)
        self.e2e.labels(*labels).observe(finished - received)
        if out.metrics.queue_time is not None:
            self.queue.labels(*labels).observe(out.metrics.queue_time)
        if first_token is not None:
            ttft = first_token - received
            self.ttft.labels(*labels).observe(ttft)
            n = out.num_output_tokens
            if n > 1:
                self.tpot.labels(*labels).observe((finished - received - ttft) / (n - 1))

    def render(self, per_key: bool = False) -> bytes:
        """The scrape; per API key only with `per_key` (see the module's doc)."""
        return generate_latest(self.registry if per_key else _WithoutLabel(self.registry, "key"))


class _WithoutLabel:
    """A registry's metrics with one label summed away (`_created` samples: the earliest)."""

    def __init__(self, registry: CollectorRegistry, label: str):
        self.registry, self.label = registry, label

    def collect(self):
        for family in self.registry.collect():
            if any(self.label in sample.labels for sample in family.samples):
                family = self._merged(family)
            yield family

    def _merged(self, family: Metric) -> Metric:
        merged = Metric(family.name, family.documentation, family.type, family.unit)
        values: dict[tuple, float] = {}
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != self.label))
            key = (sample.name, labels)
            if sample.name.endswith("_created"):
                values[key] = min(values.get(key, sample.value), sample.value)
            else:
                values[key] = values.get(key, 0.0) + sample.value
        for (name, labels), value in values.items():
            merged.add_sample(name, dict(labels), value)
        return merged
