"""Prometheus metrics under vLLM's names, so dashboards, autoscalers and llm-d read Baton unchanged.

The set is vLLM V1's (vllm/v1/metrics/loggers.py), with its help texts and buckets: the aliases
it keeps for dashboards written against older versions, and the V0 gauges its example Grafana
dashboard still plots. Each app has its own `CollectorRegistry` (several servers may share a
process in tests). Gauges and the engine's cumulative counters are read from the latest
`EngineStats` at scrape time; per-request counters and histograms are fed by the server as
outputs stream through it (`RequestTimer`), unless `--disable-log-stats` turned that off.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from baton.engine.config import EngineArgs
from baton.engine.outputs import RequestOutput
from baton.engine.protocol import EngineStats
from baton.engine.sampling_params import SamplingParams

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LABELS = ["model_name", "engine"]
# vLLM's buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0]  # fmt: skip
_REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                            50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
_PREFILL_TOKEN_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
_ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_N_BUCKETS = [1.0, 2.0, 5.0, 10.0, 20.0]
FINISH_REASONS = ("stop", "length", "abort", "error")
# Where a prompt token's KV came from (vLLM's `vllm:prompt_tokens_by_source` labels).
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
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
# vLLM's deprecated names, which dashboards written for its older versions still read.
_GPU_KV_USAGE_DOC = (
    "GPU KV-cache usage. 1 means 100 percent usage. "
    "DEPRECATED: Use vllm:kv_cache_usage_perc instead."
)
_GPU_QUERIES_DOC = (
    "GPU prefix cache queries, in terms of number of queried tokens. "
    "DEPRECATED: Use vllm:prefix_cache_queries instead."
)
_GPU_HITS_DOC = (
    "GPU prefix cache hits, in terms of number of cached tokens. "
    "DEPRECATED: Use vllm:prefix_cache_hits instead."
)
_NO_SWAP = " Always 0 in Baton: it preempts by recompute and has no CPU KV cache."
_SWAPPED_DOC = "Number of requests swapped to CPU." + _NO_SWAP
_CPU_USAGE_DOC = "CPU KV-cache usage. 1 means 100 percent usage." + _NO_SWAP


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value`: vLLM's buckets for token counts."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(float(mantissa * scale))
        scale *= 10


def cache_config_info(args: EngineArgs, num_gpu_blocks: int) -> dict[str, str]:
    """The labels of `vllm:cache_config_info` (less `engine`), as vLLM's
    `CacheConfig.metrics_info()` spells them: every value a string, Python's for booleans and
    None. llm-d's scheduler reads block_size from it."""
    return {
        "block_size": str(args.block_size),
        "cache_dtype": "auto",  # the KV cache is in the model's dtype: what vLLM calls auto
        "enable_prefix_caching": str(args.enable_prefix_caching),
        "gpu_memory_utilization": str(args.gpu_memory_utilization),
        "num_gpu_blocks": str(num_gpu_blocks),
        "num_gpu_blocks_override": str(args.num_gpu_blocks_override),
        "num_cpu_blocks": "None",  # no CPU KV cache (vLLM V1 leaves it unset too)
        "swap_space": "0",  # preemption recomputes, nothing is swapped out
    }


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
            ("vllm:gpu_cache_usage_perc", _GPU_KV_USAGE_DOC, s.kv_cache_usage),
            ("vllm:num_requests_swapped", _SWAPPED_DOC, 0),
            ("vllm:cpu_cache_usage_perc", _CPU_USAGE_DOC, 0),
            ("baton:kv_blocks_leased", _LEASED_DOC, s.kv_blocks_leased),
        )
        counters = (
            ("vllm:prefix_cache_queries", _QUERIES_DOC, s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", _HITS_DOC, s.prefix_cache_hits),
            ("vllm:gpu_prefix_cache_queries", _GPU_QUERIES_DOC, s.prefix_cache_queries),
            ("vllm:gpu_prefix_cache_hits", _GPU_HITS_DOC, s.prefix_cache_hits),
            ("vllm:num_preemptions", _PREEMPTIONS_DOC, s.num_preemptions),
            ("baton:kv_lease_expired", _EXPIRED_DOC, s.kv_leases_expired),
        )
        for family, metrics in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, doc, value in metrics:
                metric = family(name, doc, labels=_LABELS)
                metric.add_metric(self._labels, float(value))
                yield metric


class _Alias(Collector):
    """Another metric's samples under another name, made at scrape time: an alias that costs
    nothing per observation."""

    def __init__(self, source: Collector, name: str, documentation: str) -> None:
        self._source = source
        self._name = name
        self._documentation = documentation

    def collect(self) -> Iterator[Metric]:
        for metric in self._source.collect():
            alias = Metric(self._name, self._documentation, metric.type)
            suffix = len(metric.name)
            alias.samples = [s._replace(name=self._name + s.name[suffix:]) for s in metric.samples]
            yield alias


class EngineMetrics:
    """The metrics of one engine server; `render()` is the body of `GET /metrics`."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        model_name: str,
        engine: str,
        role: str = "both",
        kv_transport: str | None = None,
        *,
        max_model_len: int,  # the top of the token-count buckets
        cache_config: Mapping[str, str],  # `cache_config_info`'s labels
        log_stats: bool = True,  # False: no per-request or per-step recording (gauges stay)
    ) -> None:
        self.registry = CollectorRegistry()
        self.log_stats = log_stats
        labels = [model_name, engine]
        self.registry.register(_EngineStatsCollector(stats, labels))
        reg = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=reg).labels(*labels)

        def counters(name: str, doc: str, label: tuple[str, Sequence[str]]) -> dict[str, Counter]:
            """A counter with one more label: its child for each of the label's values."""
            family = Counter(name, doc, [*_LABELS, label[0]], registry=reg)
            return {value: family.labels(*labels, value) for value in label[1]}

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, _LABELS, registry=reg, buckets=buckets).labels(*labels)

        def latency(name: str, phase: str) -> Histogram:
            doc = f"Histogram of time spent in {phase} phase for request."
            return histogram(name, doc, _REQUEST_LATENCY_BUCKETS)

        token_buckets = build_1_2_5_buckets(max_model_len)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.prompt_tokens_by_source = counters(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            ("source", PROMPT_SOURCES),
        )
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.request_success = counters(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ("finished_reason", FINISH_REASONS),
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_prefill_kv_computed_tokens = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_buckets,
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.request_params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS
        )
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        )
        itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _LABELS,
            registry=reg,
            buckets=_ITL_BUCKETS,
        )
        self.itl = itl.labels(*labels)
        # vLLM's older name for the same observations, which its own Grafana dashboard reads.
        reg.register(
            _Alias(
                itl,
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in seconds. "
                "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
            )
        )
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = latency("vllm:request_queue_time_seconds", "WAITING")
        self.inference_time = latency("vllm:request_inference_time_seconds", "RUNNING")
        self.prefill_time = latency("vllm:request_prefill_time_seconds", "PREFILL")
        self.decode_time = latency("vllm:request_decode_time_seconds", "DECODE")
        self.prefill_time_per_token = histogram(
            "vllm:time_per_prefill_token_request_seconds",
            "Time spent per token during prefill phase in seconds",
            _PREFILL_TOKEN_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            [float(b) for b in _ITERATION_TOKEN_BUCKETS],
        )
        # An info metric as vLLM makes one: a gauge at 1 whose labels are the values.
        cache_info = {**cache_config, "engine": engine}
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(cache_info),
            registry=reg,
        ).labels(**cache_info).set(1)
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
        """Called for every message of the engine core: each carries one step's token count.
        KV pulls are counted even without `log_stats`: the operator's probe reads them."""
        if stats.step_tokens > 0 and self.log_stats:
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
    """Follows one prompt's stream of snapshots and feeds the per-request metrics.

    A prompt is one request here, its n samples together, as the client sees it: its token
    counts are over all samples (what usage reports) and it finishes with its last sample;
    `request_success` alone counts samples. The phases: queue (arrival to first scheduled) and
    prefill (first scheduled to first token) are the engine core's durations, timed there;
    decode (first token to finish) and the rest are timed here, on this process's clock.
    """

    def __init__(
        self,
        metrics: EngineMetrics,
        num_prompt_tokens: int,
        params: SamplingParams,
        num_resumed_tokens: int = 0,  # a resumed answer's: another engine generated them
    ) -> None:
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.num_samples = params.n
        self.max_tokens = params.max_tokens
        self.num_resumed_tokens = num_resumed_tokens
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time = 0.0
        self.num_tokens = num_resumed_tokens  # generated so far, over all samples
        self.finished: set[int] = set()  # indices of the samples that finished
        self.num_computed_prompt_tokens: int | None = None  # known at the first token

    def on_output(self, out: RequestOutput) -> None:
        m = self.metrics
        if not m.log_stats:
            return
        now = time.monotonic()
        num_tokens = sum(len(s.token_ids) for s in out.outputs)
        if num_tokens > self.num_tokens:
            if self.first_token_time is None:
                self.first_token_time = now
                m.ttft.observe(now - self.arrival)
                m.prompt_tokens.inc(self.num_prompt_tokens)
                self._count_prompt_sources(out)
            else:
                m.itl.observe(now - self.last_token_time)
            m.generation_tokens.inc(num_tokens - self.num_tokens)
            self.num_tokens, self.last_token_time = num_tokens, now
        for s in out.outputs:
            if s.finish_reason is not None and s.index not in self.finished:
                self.finished.add(s.index)
                m.request_success[_reason(s.finish_reason)].inc()
        if out.finished:
            self._on_finished(out, now)

    def _count_prompt_sources(self, out: RequestOutput) -> None:
        """The prompt's tokens by where their KV came from, as vLLM counts them: this engine's
        prefix cache, a prefill engine's hand-off, or computed here."""
        m = self.metrics
        local = min(out.num_cached_tokens, self.num_prompt_tokens)
        external = min(out.num_external_tokens, self.num_prompt_tokens - local)
        self.num_computed_prompt_tokens = self.num_prompt_tokens - local - external
        m.prompt_tokens_cached.inc(local + external)
        m.prompt_tokens_by_source["local_cache_hit"].inc(local)
        m.prompt_tokens_by_source["external_kv_transfer"].inc(external)
        m.prompt_tokens_by_source["local_compute"].inc(self.num_computed_prompt_tokens)

    def _on_finished(self, out: RequestOutput, now: float) -> None:
        m = self.metrics
        m.e2e.observe(now - self.arrival)
        if out.queue_time is not None:
            m.queue_time.observe(out.queue_time)
        longest = max((len(s.token_ids) for s in out.outputs), default=0)
        longest = max(0, longest - self.num_resumed_tokens)
        m.request_prompt_tokens.observe(self.num_prompt_tokens)
        if self.num_computed_prompt_tokens is not None:
            m.request_prefill_kv_computed_tokens.observe(self.num_computed_prompt_tokens)
        m.request_generation_tokens.observe(self.num_tokens - self.num_resumed_tokens)
        m.request_max_num_generation_tokens.observe(longest)
        m.request_params_n.observe(self.num_samples)
        if self.max_tokens is not None:
            m.request_params_max_tokens.observe(self.max_tokens)
        if self.first_token_time is None or out.prefill_time is None:
            return  # ended before its first token: no prefill or decode to time
        decode = now - self.first_token_time
        m.prefill_time.observe(out.prefill_time)
        m.decode_time.observe(decode)
        m.inference_time.observe(out.prefill_time + decode)
        if self.num_prompt_tokens > 0:
            m.prefill_time_per_token.observe(out.prefill_time / self.num_prompt_tokens)
        # Samples decode side by side: the longest one paces the request.
        m.request_tpot.observe(decode / (longest - 1) if longest > 1 else 0.0)

    def on_closed(self) -> None:
        """The stream ended: samples that never finished count as aborted."""
        if not self.metrics.log_stats:
            return
        for _ in range(self.num_samples - len(self.finished)):
            self.metrics.request_success["abort"].inc()
        self.finished = set(range(self.num_samples))


def _reason(reason: str) -> str:
    return reason if reason in FINISH_REASONS else "abort"
