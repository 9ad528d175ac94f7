"""The engine server's /metrics against vLLM's V1 set: every name, help text and bucket vLLM
exports, what its example Grafana dashboard reads, the HTTP metrics of its instrumentator, with
values that agree with the requests sent; `--disable-log-stats` keeps only the gauges."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.support.engine_server import MAX_MODEL_LEN, NAME, Server, start_server

pytestmark = pytest.mark.slow  # a server process

LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
       20.0, 40.0, 80.0]  # fmt: skip
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITERATION = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PREFILL_PER_TOKEN = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
TOKENS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]  # vLLM's build_1_2_5_buckets(max_model_len)
assert MAX_MODEL_LEN == 1024  # what TOKENS stops at

# vLLM V1's metrics (vllm/v1/metrics/loggers.py), by family name as the text parser gives it
# (counters without `_total`), with the bucket bounds of the histograms.
HISTOGRAMS: dict[str, Sequence[float]] = {
    "vllm:request_prompt_tokens": TOKENS,
    "vllm:request_generation_tokens": TOKENS,
    "vllm:request_max_num_generation_tokens": TOKENS,
    "vllm:request_params_max_tokens": TOKENS,
    "vllm:request_params_n": [1, 2, 5, 10, 20],
    "vllm:iteration_tokens_total": ITERATION,
    "vllm:time_to_first_token_seconds": TTFT,
    "vllm:inter_token_latency_seconds": ITL,
    "vllm:time_per_output_token_seconds": ITL,
    "vllm:request_time_per_output_token_seconds": ITL,
    "vllm:time_per_prefill_token_request_seconds": PREFILL_PER_TOKEN,
    "vllm:e2e_request_latency_seconds": LATENCY,
    "vllm:request_queue_time_seconds": LATENCY,
    "vllm:request_inference_time_seconds": LATENCY,
    "vllm:request_prefill_time_seconds": LATENCY,
    "vllm:request_decode_time_seconds": LATENCY,
    "vllm:request_prefill_kv_computed_tokens": TOKENS,
}
COUNTERS = [
    "vllm:prompt_tokens",
    "vllm:prompt_tokens_by_source",
    "vllm:prompt_tokens_cached",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:num_preemptions",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:gpu_prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits",
]
GAUGES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:num_requests_swapped",  # V0's, on vLLM's example dashboard
    "vllm:cpu_cache_usage_perc",
]
# What vLLM's example Grafana dashboard queries
# (examples/online_serving/prometheus_grafana/grafana.json), as series names.
GRAFANA = [
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:num_requests_running",
    "vllm:num_requests_swapped",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:gpu_cache_usage_perc",
    "vllm:cpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_bucket",
]
CACHE_CONFIG_LABELS = {
    "block_size",
    "cache_dtype",
    "enable_prefix_caching",
    "gpu_memory_utilization",
    "num_gpu_blocks",
    "num_cpu_blocks",
    "swap_space",
    "engine",
}


class Page:
    """One scrape of /metrics, parsed by prometheus_client's own text parser."""

    def __init__(self, url: str) -> None:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples called `name` whose labels include `labels` (0 if none)."""
        return sum(s.value for s in self.samples if _matches(s, name, labels))

    def series(self, name: str) -> list[Sample]:
        return [s for s in self.samples if s.name == name]


def _matches(sample: Sample, name: str, labels: dict[str, str]) -> bool:
    return sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())


def _scrape_until(url: str, ready: Callable[[Page], bool], timeout: float = 3.0) -> Page:
    """The first page that satisfies `ready`: the HTTP metrics of a request are recorded just
    after its last byte went out, so the client may scrape a moment before."""
    deadline = time.monotonic() + timeout
    while True:
        page = Page(url)
        if ready(page) or time.monotonic() > deadline:
            return page
        time.sleep(0.05)


def _send(url: str) -> tuple[int, int]:
    """Sends the test's requests: completions (n=2; streamed), a chat, a 400 and a 404. Returns
    the prompt and completion tokens their usage reported."""
    usages = []
    with httpx.Client(base_url=url, timeout=30) as http:
        r = http.post(
            "/v1/completions",
            json={"model": NAME, "prompt": "The relay team passed the baton", "max_tokens": 5,
                  "n": 2, "temperature": 1.0, "ignore_eos": True},
        )  # fmt: skip
        r.raise_for_status()
        usages.append(r.json()["usage"])
        body = {"model": NAME, "prompt": "Paged attention stores", "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
        with http.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            lines = [line for line in stream.iter_lines() if line.startswith("data: {")]
        usages.append(json.loads(lines[-1].removeprefix("data: "))["usage"])
        r = http.post(
            "/v1/chat/completions",
            json={"model": NAME, "messages": [{"role": "user", "content": "Hi"}],
                  "max_tokens": 3, "ignore_eos": True},
        )  # fmt: skip
        r.raise_for_status()
        usages.append(r.json()["usage"])
        assert http.post("/v1/completions", json={"model": NAME, "prompt": 7}).status_code == 400
        assert http.get("/no/such/route").status_code == 404
    return sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages)


def test_the_vllm_v1_metric_set_agrees_with_the_requests(server: Server) -> None:
    """Every metric of vLLM's V1 set and of its example dashboard is there, with vLLM's buckets
    and a help text; counts, token sums and phase times agree with the requests sent; the HTTP
    metrics count them by route template and status class."""
    before = Page(server.url)
    prompt_tokens, completion_tokens = _send(server.url)
    http_total = "http_requests_total"
    after = _scrape_until(server.url, lambda p: p.value(http_total, handler="none") > 0)

    def delta(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    # The set, its help texts and buckets.
    for name in [*HISTOGRAMS, *COUNTERS, *GAUGES]:
        assert name in after.families, name
    for name in GRAFANA:
        assert after.series(name), name
    for family in after.families.values():
        assert family.documentation, family.name
    for name, bounds in HISTOGRAMS.items():
        les = [s.labels["le"] for s in after.series(f"{name}_bucket")]
        assert les == [str(float(b)) for b in bounds] + ["+Inf"], name
        assert {s.labels["model_name"] for s in after.series(f"{name}_count")} == {NAME}

    # Counts and sums: three prompts (one with n=2), all cut at max_tokens.
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:request_success_total", finished_reason="length") == 4
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") == completion_tokens == 2 * 5 + 4 + 3
    assert delta("vllm:request_prompt_tokens_count") == 3
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    sources = {
        s: delta("vllm:prompt_tokens_by_source_total", source=s)
        for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }
    assert sum(sources.values()) == prompt_tokens and sources["external_kv_transfer"] == 0
    assert delta("vllm:prompt_tokens_cached_total") == sources["local_cache_hit"]
    assert delta("vllm:request_prefill_kv_computed_tokens_count") == 3
    assert delta("vllm:request_prefill_kv_computed_tokens_sum") == sources["local_compute"]
    assert delta("vllm:request_generation_tokens_sum") == completion_tokens
    assert delta("vllm:request_max_num_generation_tokens_sum") == 5 + 4 + 3
    assert delta("vllm:request_params_max_tokens_sum") == 5 + 4 + 3
    assert delta("vllm:request_params_n_sum") == 2 + 1 + 1
    assert delta("vllm:request_params_n_bucket", le="1.0") == 2
    assert delta("vllm:request_params_n_bucket", le="2.0") == 3
    for name in (
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:time_per_prefill_token_request_seconds",
        "vllm:time_to_first_token_seconds",
    ):
        assert delta(f"{name}_count") == 3, name
    itl = delta("vllm:inter_token_latency_seconds_count")
    assert itl > 0 and delta("vllm:time_per_output_token_seconds_count") == itl

    # The phases add up: queue + prefill come before the first token, prefill + decode is the
    # time running, and queue + running fits in the end-to-end latency.
    queue, prefill, decode, inference, ttft, e2e = (
        delta(f"vllm:{n}_sum")
        for n in (
            "request_queue_time_seconds",
            "request_prefill_time_seconds",
            "request_decode_time_seconds",
            "request_inference_time_seconds",
            "time_to_first_token_seconds",
            "e2e_request_latency_seconds",
        )
    )
    assert prefill > 0 and decode > 0
    assert math.isclose(prefill + decode, inference, rel_tol=1e-9)
    assert queue + prefill <= ttft + 0.01
    assert queue + inference <= e2e + 0.01
    assert delta("vllm:request_time_per_output_token_seconds_sum") > 0

    # The aliases and V0 gauges.
    assert after.value("vllm:gpu_cache_usage_perc") == after.value("vllm:kv_cache_usage_perc")
    for old, new in (("gpu_prefix_cache_queries", "prefix_cache_queries"),
                     ("gpu_prefix_cache_hits", "prefix_cache_hits")):  # fmt: skip
        assert after.value(f"vllm:{old}_total") == after.value(f"vllm:{new}_total")
    assert after.value("vllm:prefix_cache_queries_total") > 0
    assert after.value("vllm:num_requests_swapped") == 0
    assert after.value("vllm:cpu_cache_usage_perc") == 0

    # The cache config, as llm-d's scheduler reads it.
    (info,) = after.series("vllm:cache_config_info")
    assert info.value == 1 and set(info.labels) >= CACHE_CONFIG_LABELS
    health = httpx.get(f"{server.url}/health", timeout=5).json()
    assert info.labels["block_size"] == str(health["block_size"])
    assert int(info.labels["num_gpu_blocks"]) > 0 and info.labels["engine"] == "0"
    assert info.labels["enable_prefix_caching"] == "True"

    # The HTTP metrics: by route template and status class, /metrics itself left out.
    assert delta(http_total, handler="/v1/completions", method="POST", status="2xx") == 2
    assert delta(http_total, handler="/v1/chat/completions", method="POST", status="2xx") == 1
    assert delta(http_total, handler="/v1/completions", method="POST", status="4xx") == 1
    assert delta(http_total, handler="none", method="GET", status="4xx") == 1
    assert not [s for s in after.series(http_total) if s.labels["handler"] == "/metrics"]
    duration = "http_request_duration_seconds"
    assert delta(f"{duration}_count", handler="/v1/completions", method="POST") == 3
    duration_les = {s.labels["le"] for s in after.series(f"{duration}_bucket")}
    assert duration_les == {"0.1", "0.5", "1.0", "+Inf"}


def test_disable_log_stats_keeps_the_gauges_only(model: Path, tmp_path: Path) -> None:
    """With --disable-log-stats a request leaves every per-request metric at 0; the gauges,
    the cache config and the HTTP metrics are still there."""
    s = start_server(model, tmp_path, "--disable-log-stats")
    try:
        s.client().completions.create(model=NAME, prompt="unrecorded", max_tokens=3)
        page = _scrape_until(s.url, lambda p: p.value("http_requests_total") > 0)
    finally:
        s.stop()
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:iteration_tokens_total_count"):  # fmt: skip
        assert page.value(name) == 0, name
    assert page.series("vllm:num_requests_running") and page.series("vllm:cache_config_info")
    assert page.value("vllm:prefix_cache_queries_total") > 0  # the engine's own counters
    assert page.value("http_requests_total", handler="/v1/completions", status="2xx") == 1
