"""The router's Prometheus metrics (`GET /metrics`), all under `baton:router_*`.

Counters and histograms are fed as requests pass; per-engine gauges (in flight, healthy, load)
and per-model ones (compatible prefill/decode pairs) are read from the `EngineSet` at scrape
time. Each router has its own registry.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from baton.router.engines import EngineSet

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DisaggOutcome = Literal[
    "disaggregated", "skipped_short", "skipped_cached", "decode_only_fallback", "failed"
]
DISAGG_OUTCOMES: tuple[DisaggOutcome, ...] = get_args(DisaggOutcome)
MigrationOutcome = Literal["resumed", "failed", "limit_reached"]
MIGRATION_OUTCOMES: tuple[MigrationOutcome, ...] = get_args(MigrationOutcome)
# How a request held for an engine of its model ended (`hold`): let go to routing, out of time,
# refused on a full queue, its client gone, or the router stopping.
HoldOutcome = Literal["released", "timed_out", "rejected", "abandoned", "shutdown"]
HOLD_OUTCOMES: tuple[HoldOutcome, ...] = get_args(HoldOutcome)
ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
_LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0, 300.0, 600.0]  # fmt: skip


class _EngineGauges(Collector):
    """Per-engine gauges, read from the engine set when scraped."""

    def __init__(self, engines: EngineSet) -> None:
        self._engines = engines

    def collect(self) -> Iterator[Metric]:
        labels = ["engine", "role"]
        in_flight = GaugeMetricFamily(
            "baton:router_in_flight", "Requests this router has open on the engine.", labels=labels
        )
        healthy = GaugeMetricFamily(
            "baton:router_engine_healthy",
            "1 when the engine may take requests (healthy and not ejected).",
            labels=labels,
        )
        load = GaugeMetricFamily(
            "baton:router_engine_load",
            "The engine's running + waiting requests as the router estimates them.",
            labels=labels,
        )
        now = time.monotonic()
        for s in self._engines:
            key = [s.url, s.role]
            in_flight.add_metric(key, s.in_flight)
            healthy.add_metric(key, 1.0 if s.available(now) else 0.0)
            load.add_metric(key, s.load())
        yield in_flight
        yield healthy
        yield load
        # A gauge, not a counter of requests that found no pair: whether disaggregation can
        # work is a state of the fleet (alert on 0 while a model has prefill engines, during a
        # rollout say), true before any request comes; the requests it costs are counted by
        # outcome already (decode_only_fallback, failed).
        pairs = GaugeMetricFamily(
            "baton:router_compatible_pairs",
            "Pairs of available prefill and decode engines of the model that may hand off KV "
            "(equal fingerprint and tensor_parallel_size where both engines say); 0: none.",
            labels=["model"],
        )
        for model in self._engines.disaggregated_models():
            pairs.add_metric([model], self._engines.compatible_pairs(model))
        yield pairs


class RouterMetrics:
    """The router's metrics; `render()` is the body of `GET /metrics`."""

    def __init__(self, engines: EngineSet) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.registry.register(_EngineGauges(engines))
        self._requests = Counter(
            "baton:router_requests",
            "Requests answered by the router, by route and HTTP status.",
            ["route", "code"],
            registry=reg,
        )
        self._retries = Counter(
            "baton:router_retries",
            "Requests sent again to another engine after a failure before the first byte.",
            ["route"],
            registry=reg,
        )
        self._upstream_errors = Counter(
            "baton:router_upstream_errors",
            "Failed requests to an engine (connection, timeout, 5xx, broken stream).",
            ["engine", "kind"],
            registry=reg,
        )
        self._ejections = Counter(
            "baton:router_ejections",
            "Times an engine was taken out of rotation by failed requests or health checks.",
            ["engine"],
            registry=reg,
        )
        disagg = Counter(
            "baton:router_disagg_decisions",
            "How each request to a disaggregated model was served.",
            ["outcome"],
            registry=reg,
        )
        self._disagg = {o: disagg.labels(o) for o in DISAGG_OUTCOMES}
        migrations = Counter(
            "baton:router_migrations",
            "Streams moved to another engine after theirs failed mid-stream: resumed there, "
            "failed (no engine could take it), or limit_reached (--migration-limit).",
            ["outcome"],
            registry=reg,
        )
        self._migrations = {o: migrations.labels(o) for o in MIGRATION_OUTCOMES}
        # Pushed by `hold.Holds` as its queues change: KEDA wakes a pool at zero on it, so it
        # shows 0 for every model the router knows (`hold_model`), not only for those that held
        # a request.
        self._held = Gauge(
            "baton:router_held_requests",
            "Requests waiting for an engine of their model (none up: a pool at zero).",
            ["model"],
            registry=reg,
        )
        self._hold_outcomes = Counter(
            "baton:router_hold_outcomes",
            "How held requests ended: released to routing, timed_out, rejected (queue full), "
            "abandoned (client left) or shutdown (router stopping).",
            ["model", "outcome"],
            registry=reg,
        )
        self._hold_seconds = Histogram(
            "baton:router_hold_seconds",
            "How long requests were held for an engine of their model, whatever the outcome.",
            registry=reg,
            buckets=_LATENCY_BUCKETS,
        )

        def latency(name: str, doc: str) -> dict[str, Histogram]:
            histogram = Histogram(name, doc, ["route"], registry=reg, buckets=_LATENCY_BUCKETS)
            return {r: histogram.labels(r) for r in ROUTES}

        self._duration = latency(
            "baton:router_request_duration_seconds",
            "From the request's arrival to the end of its response, by route.",
        )
        self._first_byte = latency(
            "baton:router_time_to_first_byte_seconds",
            "From the request's arrival to the first byte of the answering engine, by route.",
        )

    def request(self, route: str, code: int) -> None:
        self._requests.labels(route, str(code)).inc()

    def retry(self, route: str) -> None:
        self._retries.labels(route).inc()

    def upstream_error(self, engine: str, kind: str) -> None:
        self._upstream_errors.labels(engine, kind).inc()

    def ejection(self, engine: str) -> None:
        self._ejections.labels(engine).inc()

    def disagg_decision(self, outcome: DisaggOutcome) -> None:
        self._disagg[outcome].inc()

    def migration(self, outcome: MigrationOutcome) -> None:
        self._migrations[outcome].inc()

    def hold_model(self, model: str) -> None:
        """`model` is known: its held-requests gauge and hold outcomes show 0 until they move
        (KEDA needs the gauge before any request; `increase()` needs each counter's 0)."""
        self._held.labels(model).set(0)
        for outcome in HOLD_OUTCOMES:
            self._hold_outcomes.labels(model, outcome)

    def held(self, model: str, count: int) -> None:
        """`count` requests wait for an engine of `model` now."""
        self._held.labels(model).set(count)

    def hold_outcome(self, model: str, outcome: HoldOutcome, seconds: float | None) -> None:
        """A request for `model` ended its hold after `seconds` (None: it was never held)."""
        self._hold_outcomes.labels(model, outcome).inc()
        if seconds is not None:
            self._hold_seconds.observe(seconds)

    def duration(self, route: str, seconds: float) -> None:
        _observe(self._duration, route, seconds)

    def first_byte(self, route: str, seconds: float) -> None:
        _observe(self._first_byte, route, seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _observe(by_route: dict[str, Histogram], route: str, seconds: float) -> None:
    histogram = by_route.get(route)  # only `ROUTES` have one
    if histogram is not None:
        histogram.observe(seconds)
