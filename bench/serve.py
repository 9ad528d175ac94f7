"""Online serving benchmark: a load generator for any OpenAI-compatible `/v1/completions` server.

Metrics are defined the way `vllm bench serve` defines them, so numbers are comparable:

- TTFT: from sending a request to its first content chunk.
- TPOT: per request, (E2EL - TTFT) / (output_tokens - 1); requests with one output token are left
  out, since they have no token after the first.
- ITL: every gap between two successive content chunks, over all requests.
- E2EL: from sending a request to its last content chunk.
- Throughputs divide by the benchmark duration (first send to last response); goodput counts only
  the requests that meet every SLO given with `--goodput`.

Failed requests are left out of every metric and counted apart. Each latency is timed from when the
request leaves the client, after it passed the `--max-concurrency` semaphore, as vLLM does.

    python bench/serve.py --num-prompts 256 --max-concurrency 64 \\
        --random-input-len 256 --random-output-len 128 [--offline-baseline --model-path PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np

ArrivalKind = Literal["poisson", "fixed"]
SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
FIRST_REGULAR_TOKEN_ID = 3  # ids 0-2 are special tokens in Baton's tiny tokenizer
DEFAULT_PERCENTILE = 99.0


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run: where to send, what to send, and when."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the first model the server lists at /v1/models
    num_prompts: int = 200
    random_input_len: int = 256
    random_output_len: int = 128
    random_range_ratio: float = 0.0  # lengths uniform in [len * (1 - r), len * (1 + r)]
    vocab_size: int = 2048  # prompt ids are drawn from [3, vocab_size)
    request_rate: float = math.inf  # requests per second; inf sends every request at once
    arrival: ArrivalKind = "poisson"
    max_concurrency: int | None = None  # None: no cap on requests in flight
    seed: int = 0
    percentiles: tuple[float, ...] = (DEFAULT_PERCENTILE,)
    slos_ms: Mapping[str, float] = field(default_factory=dict)  # e.g. {"ttft": 500}
    timeout_s: float = 600.0  # per request, also the longest wait between two chunks
    num_warmups: int = 0  # requests sent one by one before the timed run, not measured

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.random_input_len < 1 or self.random_output_len < 1:
            raise ValueError("random_input_len and random_output_len must be >= 1")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1), got {self.random_range_ratio}")
        if self.vocab_size <= FIRST_REGULAR_TOKEN_ID:
            raise ValueError(
                f"vocab_size must be > {FIRST_REGULAR_TOKEN_ID}, got {self.vocab_size}"
            )
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if self.arrival not in ("poisson", "fixed"):
            raise ValueError(f"arrival must be 'poisson' or 'fixed', got {self.arrival!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if any(not 0.0 < p < 100.0 for p in self.percentiles):
            raise ValueError(f"percentiles must be in (0, 100), got {self.percentiles}")
        check_slos(self.slos_ms)
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")


@dataclass(frozen=True)
class SampledRequest:
    """One request of the workload."""

    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class RequestRecord:
    """What the client saw of one request; times in seconds, from when it was sent."""

    prompt_len: int
    success: bool = False
    output_tokens: int = 0  # from the usage chunk, else the number of content chunks
    ttft: float = 0.0
    latency: float = 0.0  # E2EL: time of the last content chunk
    itl: list[float] = field(default_factory=list)  # gaps between successive content chunks
    error: str | None = None


@dataclass
class BenchmarkResult:
    """A finished run: its configuration, the per-request records and the metrics."""

    config: BenchConfig
    model: str
    duration: float
    records: list[RequestRecord]
    metrics: dict[str, Any]


def check_slos(slos_ms: Mapping[str, float]) -> None:
    """Raises ValueError unless every SLO names a known metric and a positive bound in ms."""
    for name, bound in slos_ms.items():
        if name not in SLO_METRICS:
            raise ValueError(f"unknown SLO metric {name!r}; choose from {', '.join(SLO_METRICS)}")
        if not bound > 0:
            raise ValueError(f"SLO {name} must be a positive number of ms, got {bound}")


# ---------------------------------------------------------------- workload and arrivals


def sample_random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
) -> list[SampledRequest]:
    """Random token-id prompts with lengths uniform in [len * (1 - r), len * (1 + r)], as vLLM's
    random dataset draws them."""
    rng = np.random.default_rng(seed)

    def lengths(mean: int) -> np.ndarray:
        low = max(1, math.floor(mean * (1 - range_ratio)))
        high = max(low, math.ceil(mean * (1 + range_ratio)))
        return rng.integers(low, high + 1, size=num_prompts)

    input_lens, output_lens = lengths(input_len), lengths(output_len)
    return [
        SampledRequest(
            prompt_token_ids=rng.integers(FIRST_REGULAR_TOKEN_ID, vocab_size, size=n).tolist(),
            max_tokens=int(m),
        )
        for n, m in zip(input_lens, output_lens, strict=True)
    ]


def arrival_times(n: int, request_rate: float, arrival: ArrivalKind, seed: int) -> list[float]:
    """Send times in seconds from the start: the first at 0, then gaps that are exponential with
    mean 1 / rate (`poisson`) or exactly 1 / rate (`fixed`); all 0 for an infinite rate."""
    if n < 1:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    if arrival == "poisson":
        gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=n - 1)
    else:
        gaps = np.full(n - 1, 1.0 / request_rate)
    return [0.0, *np.cumsum(gaps).tolist()]


# ---------------------------------------------------------------- client


def _sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for comments, blank lines and other fields."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()


async def send_request(
    client: httpx.AsyncClient, url: str, model: str, request: SampledRequest
) -> RequestRecord:
    """Streams one completion and times its chunks; never raises, failures land in `error`."""
    record = RequestRecord(prompt_len=len(request.prompt_token_ids))
    payload = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    content_chunks = 0
    usage_tokens: int | None = None
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")[:500]
                record.error = f"HTTP {response.status_code}: {body}"
                return record
            async for line in response.aiter_lines():
                data = _sse_data(line)
                if not data:
                    continue
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    record.error = f"server error in stream: {chunk['error']}"
                    return record
                if chunk.get("usage") and chunk["usage"].get("completion_tokens") is not None:
                    usage_tokens = int(chunk["usage"]["completion_tokens"])
                if not _is_token_chunk(chunk):
                    continue
                now = time.perf_counter()
                if content_chunks == 0:
                    record.ttft = now - start
                else:
                    record.itl.append(now - last)
                last = now
                content_chunks += 1
    except Exception as e:  # a load generator reports a broken request and carries on
        record.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return record
    if content_chunks == 0:
        record.error = "the stream ended without a content chunk"
        return record
    record.success = True
    record.latency = last - start
    record.output_tokens = usage_tokens if usage_tokens is not None else content_chunks
    return record


def _is_token_chunk(chunk: dict[str, Any]) -> bool:
    """A chunk with a choice counts as a token arrival, as in vLLM, except a trailing chunk with
    no text that only carries the finish reason: timing it would add a near-zero ITL gap."""
    choices = chunk.get("choices")
    if not choices:
        return False
    choice = choices[0]
    return bool(choice.get("text")) or choice.get("finish_reason") is None


async def fetch_first_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The id of the first model the server lists at /v1/models."""
    url = f"{base_url}/v1/models"
    try:
        response = await client.get(url)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise RuntimeError(f"could not read a model name from {url} ({e}); pass --model") from e


def workload(
    config: BenchConfig, num_prompts: int | None = None, seed_offset: int = 0
) -> list[SampledRequest]:
    """The configured random workload (`num_prompts` of them unless given)."""
    return sample_random_requests(
        config.num_prompts if num_prompts is None else num_prompts,
        config.random_input_len,
        config.random_output_len,
        config.random_range_ratio,
        config.vocab_size,
        config.seed + seed_offset,
    )


async def run_benchmark(
    config: BenchConfig, requests: Sequence[SampledRequest] | None = None
) -> BenchmarkResult:
    """Sends the workload (by default the configured one) at the configured arrival times."""
    if requests is None:
        requests = workload(config)
    base_url = config.base_url.rstrip("/")
    url = base_url + config.endpoint
    in_flight = min(config.max_concurrency or len(requests), len(requests))
    # One connection per request in flight, so the pool never queues what the semaphore let go.
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    timeout = httpx.Timeout(config.timeout_s, connect=min(config.timeout_s, 30.0), pool=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        model = config.model or await fetch_first_model(client, base_url)
        # Warm-up prompts differ from the measured ones, so no prefix cache hit flatters those.
        for request in workload(config, config.num_warmups, seed_offset=1):
            await send_request(client, url, model, request)

        semaphore = asyncio.Semaphore(in_flight)

        async def limited(request: SampledRequest) -> RequestRecord:
            async with semaphore:
                return await send_request(client, url, model, request)

        offsets = arrival_times(len(requests), config.request_rate, config.arrival, config.seed)
        tasks = []
        start = time.perf_counter()
        for request, offset in zip(requests, offsets, strict=True):
            # Sleep to absolute send times, so a slow loop iteration does not shift later ones.
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(request)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    metrics = compute_metrics(records, duration, config.slos_ms, config.percentiles)
    return BenchmarkResult(config, model, duration, records, metrics)


# ---------------------------------------------------------------- metrics


def percentile_label(p: float) -> str:
    """`99` for 99.0, `99.9` for 99.9: the `p99` in `p99_ttft_ms`."""
    return str(int(p)) if float(p).is_integer() else str(p)


def compute_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    slos_ms: Mapping[str, float] | None = None,
    percentiles: Sequence[float] = (DEFAULT_PERCENTILE,),
) -> dict[str, Any]:
    """The vLLM serving metrics of finished requests; latencies in ms, throughputs per second.

    Pure: depends only on its arguments. Latency statistics of an empty set are 0, as in vLLM.
    `request_goodput` is None when no SLO is given.
    """
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    slos_ms = dict(slos_ms or {})
    check_slos(slos_ms)
    done = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    # TPOT per request; vLLM scores a one-token request's TPOT as 0 against an SLO.
    tpots = [
        (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None for r in done
    ]
    samples_s: dict[str, list[float]] = {
        "ttft": [r.ttft for r in done],
        "tpot": [t for t in tpots if t is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(failed),
        "first_error": failed[0].error if failed else None,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "request_goodput": None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    if slos_ms:
        good = sum(
            1
            for r, tpot in zip(done, tpots, strict=True)
            if _meets_slos({"ttft": r.ttft, "tpot": tpot or 0.0, "e2el": r.latency}, slos_ms)
        )
        metrics["request_goodput"] = good / duration
    for name in LATENCY_METRICS:
        values_ms = np.asarray(samples_s[name], dtype=float) * 1000.0
        if values_ms.size == 0:
            values_ms = np.zeros(1)
        metrics[f"mean_{name}_ms"] = float(np.mean(values_ms))
        metrics[f"median_{name}_ms"] = float(np.median(values_ms))
        metrics[f"std_{name}_ms"] = float(np.std(values_ms))
        for p in percentiles:
            metrics[f"p{percentile_label(p)}_{name}_ms"] = float(np.percentile(values_ms, p))
    return metrics


def _meets_slos(values_s: Mapping[str, float], slos_ms: Mapping[str, float]) -> bool:
    return all(values_s[name] * 1000.0 <= bound for name, bound in slos_ms.items())


# ---------------------------------------------------------------- offline baseline


def run_offline(
    model_path: str, requests: Sequence[SampledRequest], max_model_len: int | None
) -> tuple[int, float]:
    """Generates the same requests with `baton.LLM` in this process: (output tokens, seconds)."""
    from baton import LLM, SamplingParams  # lazy: the load generator itself needs no torch

    max_len = max_model_len or max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    llm = LLM(model_path, max_model_len=max_len)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests
    ]
    llm.generate(prompts[:4], params[:4])  # warm-up, as the server is warm by the time it is hit
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs), elapsed


# ---------------------------------------------------------------- report and CLI

_WIDTH = 50


def _banner(title: str, fill: str) -> str:
    return f"{title:{fill}^{_WIDTH}}"


def _row(label: str, value: object) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40} {text:<10}"


_SECTIONS = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def format_table(result: BenchmarkResult) -> str:
    """The human-readable report, laid out like `vllm bench serve`'s."""
    m, c = result.metrics, result.config
    lines = [
        _banner(" Serving Benchmark Result ", "="),
        _row("Model:", result.model),
        _row("Traffic request rate:", "inf" if math.isinf(c.request_rate) else c.request_rate),
        _row("Arrival process:", c.arrival),
        _row("Maximum request concurrency:", c.max_concurrency or "none"),
        _row("Successful requests:", m["completed"]),
        _row("Failed requests:", m["failed"]),
        _row("Benchmark duration (s):", m["duration"]),
        _row("Total input tokens:", m["total_input_tokens"]),
        _row("Total generated tokens:", m["total_output_tokens"]),
        _row("Request throughput (req/s):", m["request_throughput"]),
    ]
    if m["request_goodput"] is not None:
        lines.append(_row("Request goodput (req/s):", m["request_goodput"]))
    lines += [
        _row("Output token throughput (tok/s):", m["output_throughput"]),
        _row("Total token throughput (tok/s):", m["total_token_throughput"]),
    ]
    for name, (title, short) in _SECTIONS.items():
        lines.append(_banner(title, "-"))
        lines.append(_row(f"Mean {short} (ms):", m[f"mean_{name}_ms"]))
        lines.append(_row(f"Median {short} (ms):", m[f"median_{name}_ms"]))
        for p in c.percentiles:
            label = percentile_label(p)
            lines.append(_row(f"P{label} {short} (ms):", m[f"p{label}_{name}_ms"]))
    lines.append("=" * _WIDTH)
    if m["first_error"]:
        lines.append(f"First error: {m['first_error']}")
    return "\n".join(lines)


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0}; ValueError on bad input."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep:
            raise ValueError(f"goodput SLO {item!r} is not KEY:MS, e.g. ttft:500")
        try:
            slos[name.strip().lower()] = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number of ms") from None
    check_slos(slos)
    return slos


def parse_percentiles(items: Sequence[str]) -> tuple[float, ...]:
    """`["50,90", "99"]` -> (50.0, 90.0, 99.0); p99 is always reported."""
    values = {float(v) for item in items for v in item.split(",") if v.strip()}
    return tuple(sorted(values | {DEFAULT_PERCENTILE}))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name (default: first from /v1/models)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf: all at once")
    p.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", nargs="+", default=[], help="e.g. 50 90 99 (p99 always)")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS", help="ttft:500 tpot:50")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write every number to this file")
    p.add_argument("--offline-baseline", action="store_true", help="also run baton.LLM offline")
    p.add_argument("--model-path", default=None, help="model folder for --offline-baseline")
    p.add_argument("--max-model-len", type=int, default=None, help="for --offline-baseline")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        num_prompts=args.num_prompts,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        vocab_size=args.vocab_size,
        request_rate=args.request_rate,
        arrival=args.arrival,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        percentiles=parse_percentiles(args.percentiles),
        slos_ms=parse_goodput(args.goodput),
        timeout_s=args.timeout,
        num_warmups=args.num_warmups,
    )


def result_to_json(result: BenchmarkResult, offline: dict[str, float] | None) -> dict[str, Any]:
    config = asdict(result.config)
    config["slos_ms"] = dict(result.config.slos_ms)
    if math.isinf(result.config.request_rate):
        config["request_rate"] = "inf"  # JSON has no infinity
    return {
        "model": result.model,
        "config": config,
        "metrics": result.metrics,
        "offline": offline,
        "requests": [asdict(r) for r in result.records],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.offline_baseline and not args.model_path:
        parser.error("--offline-baseline needs --model-path")
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    requests = workload(config)
    try:
        result = asyncio.run(run_benchmark(config, requests))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    offline: dict[str, float] | None = None
    if args.offline_baseline:
        tokens, seconds = run_offline(args.model_path, requests, args.max_model_len)
        offline_tput = tokens / seconds
        ratio = result.metrics["output_throughput"] / offline_tput
        offline = {
            "output_tokens": tokens,
            "duration": seconds,
            "output_throughput": offline_tput,
            "online_to_offline_ratio": ratio,
        }
        print(_banner(" Offline Baseline (baton.LLM) ", "="))
        print(_row("Offline output throughput (tok/s):", offline_tput))
        print(_row("Online output throughput (tok/s):", result.metrics["output_throughput"]))
        print(_row("Online / offline (goal >= 0.80 at 64):", ratio))
        print("=" * _WIDTH)
    if args.json is not None:
        args.json.write_text(json.dumps(result_to_json(result, offline), indent=2))
    return 1 if result.metrics["completed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
