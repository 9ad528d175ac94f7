"""Prometheus metrics under vLLM's names, so dashboards, autoscalers and llm-d read Baton unchanged.

Each app has its own `CollectorRegistry` (several servers may share a process in tests). Gauges
and the engine's cumulative counters are read from the latest `EngineStats` at scrape time;
per-request counters and histograms are fed by the server as outputs stream through it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from baton.engine.outputs import RequestOutput
from baton.engine.protocol import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LABELS = ["model_name", "engine"]
# vLLM's buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0]  # fmt: skip
_REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                            50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
_ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
FINISH_REASONS = ("stop", "length", "abort", "error")
# Transfer times from a small block run on loopback to a large prompt over a slow link.
_KV_TRANSFER_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                        2.5, 5.0, 10.0, 30.0]  # fmt: skip
_RUNNING_DOC = "Number of requests in model execution batches."
_WAITING_DOC = "Number of requests waiting to be processed."
_KV_USAGE_DOC = "KV-cache usage. 1 means 100 percent usage."
_QUERIES_DOC = "Prefix cache queries, in terms of number of queried tokens."
_HITS_DOC = "Prefix cache hits, in terms of number of cached tokens."
_PREEMPTIONS_DOC = "Cumulative number of preemption from the engine."
_LEASED_DOC = "KV blocks held for decode engines to pull (prefill side)."
_EXPIRED_DOC = "KV leases that expired before a decode engine claimed them."


class _EngineStatsCollector(Collector):
    """Yields the engine's gauges and cumulative counters from its latest stats."""

    def __init__(self, stats: Callable[[], EngineStats], labels: list[str]) -> None:
        self._stats = stats
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = (
            ("vllm:num_requests_running", _RUNNING_DOC, s.num_running),
            ("vllm:num_requests_waiting", _WAITING_DOC, s.num_waiting),
            ("vllm:kv_cache_usage_perc", _KV_USAGE_DOC, s.kv_cache_usage),
            ("baton:kv_blocks_leased", _LEASED_DOC, s.kv_blocks_leased),
        )
        counters = (
            ("vllm:prefix_cache_queries", _QUERIES_DOC, s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", _HITS_DOC, s.prefix_cache_hits),
            ("vllm:num_preemptions", _PREEMPTIONS_DOC, s.num_preemptions),
            ("baton:kv_lease_expired", _EXPIRED_DOC, s.kv_leases_expired),
        )
        for family, metrics in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, doc, value in metrics:
                metric = family(name, doc, labels=_LABELS)
                metric.add_metric(self._labels, float(value))
                yield metric


class EngineMetrics:
    """The metrics of one engine server; `render()` is the body of `GET /metrics`."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        model_name: str,
        engine: str,
        role: str = "both",
        kv_transport: str | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        labels = [model_name, engine]
        self.registry.register(_EngineStatsCollector(stats, labels))
        reg = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=reg).labels(*labels)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, _LABELS, registry=reg, buckets=buckets).labels(*labels)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*_LABELS, "finished_reason"],
            registry=reg,
        )
        self.request_success = {r: success.labels(*labels, r) for r in FINISH_REASONS}
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            [float(b) for b in _ITERATION_TOKEN_BUCKETS],
        )
        info = Gauge(
            "baton:engine_info",
            "The engine's disaggregation role and KV transport (value 1).",
            [*_LABELS, "role", "kv_transport"],
            registry=reg,
        )
        info.labels(*labels, role, kv_transport or "none").set(1)
        self.kv_transfer_bytes = counter(
            "baton:kv_transfer_bytes", "Bytes of KV cache pulled from prefill engines."
        )
        self.kv_transfer_seconds = histogram(
            "baton:kv_transfer_seconds",
            "Time of each KV pull from a prefill engine, successful or not.",
            _KV_TRANSFER_BUCKETS,
        )
        self._kv_failures = Counter(
            "baton:kv_transfer_failures",
            "KV pulls that failed, by reason (the request was recomputed or failed).",
            [*_LABELS, "reason"],
            registry=reg,
        )
        self._kv_incompatible = Counter(
            "baton:kv_transfer_incompatible",
            "Hand-offs refused before any pull because the two engines differ, by the first "
            "field that differs (weights, dtype, tokenizer, chat_template, prompt, ...).",
            [*_LABELS, "reason"],
            registry=reg,
        )
        self._labels = labels

    def observe_step(self, stats: EngineStats) -> None:
        """Called for every message of the engine core: each carries one step's token count."""
        if stats.step_tokens > 0:
            self.iteration_tokens.observe(stats.step_tokens)
        for result in stats.kv_transfers:
            self.kv_transfer_bytes.inc(result.num_bytes)
            self.kv_transfer_seconds.observe(result.seconds)
            if result.reason:
                self._kv_failures.labels(*self._labels, result.reason).inc()
            if result.reason == "INCOMPATIBLE" and result.error:
                field = result.error.split(":", 1)[1].split()[0]  # "INCOMPATIBLE: dtype differs"
                self._kv_incompatible.labels(*self._labels, field).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Follows one prompt's stream of snapshots and feeds the per-request metrics."""

    def __init__(self, metrics: EngineMetrics, num_prompt_tokens: int, num_samples: int) -> None:
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.num_samples = num_samples
        self.arrival = time.monotonic()
        self.last_token_time: float | None = None
        self.num_tokens = 0  # generated so far, over all samples
        self.finished: set[int] = set()  # indices of the samples that finished

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        num_tokens = sum(len(s.token_ids) for s in out.outputs)
        if num_tokens > self.num_tokens:
            if self.last_token_time is None:
                self.metrics.ttft.observe(now - self.arrival)
                self.metrics.prompt_tokens.inc(self.num_prompt_tokens)
            else:
                self.metrics.itl.observe(now - self.last_token_time)
            self.metrics.generation_tokens.inc(num_tokens - self.num_tokens)
            self.num_tokens, self.last_token_time = num_tokens, now
        for s in out.outputs:
            if s.finish_reason is not None and s.index not in self.finished:
                self.finished.add(s.index)
                self.metrics.request_success[_reason(s.finish_reason)].inc()
        if out.finished:
            self.metrics.e2e.observe(now - self.arrival)
            if out.queue_time is not None:
                self.metrics.queue_time.observe(out.queue_time)

    def on_closed(self) -> None:
        """The stream ended: samples that never finished count as aborted."""
        for _ in range(self.num_samples - len(self.finished)):
            self.metrics.request_success["abort"].inc()
        self.finished = set(range(self.num_samples))


def _reason(reason: str) -> str:
    return reason if reason in FINISH_REASONS else "abort"
