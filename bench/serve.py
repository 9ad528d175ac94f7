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
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np

if not __package__:  # run as `python bench/serve.py`: make the `bench` folder importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve_metrics import (
    DEFAULT_PERCENTILE,
    RequestRecord,
    check_slos,
    compute_metrics,
    format_offline_baseline,
    format_rounds,
    format_server_cpu,
    format_table,
    parse_goodput,
    parse_percentiles,
)

ArrivalKind = Literal["poisson", "fixed"]
FIRST_REGULAR_TOKEN_ID = 3  # ids 0-2 are special tokens in Baton's tiny tokenizer


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
class BenchmarkResult:
    """A finished run: its configuration, the per-request records and the metrics."""

    config: BenchConfig
    model: str
    duration: float
    records: list[RequestRecord]
    metrics: dict[str, Any]


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


# ---------------------------------------------------------------- offline baseline


def server_kv_cache(base_url: str) -> tuple[int | None, int | None]:
    """The server's (max_model_len, KV cache blocks), from its /v1/models and the
    `vllm:cache_config_info` of its /metrics; None for what it does not say."""
    max_len = blocks = None
    with httpx.Client(timeout=30.0) as client:
        try:
            max_len = client.get(f"{base_url}/v1/models").json()["data"][0].get("max_model_len")
            metrics = client.get(f"{base_url}/metrics").text
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            return max_len, None
    found = re.search(r'^vllm:cache_config_info\{[^}]*\bnum_gpu_blocks="(\d+)"', metrics, re.M)
    blocks = int(found.group(1)) if found else None
    return max_len, blocks


def offline_engine(
    model_path: str,
    requests: Sequence[SampledRequest],
    max_model_len: int | None,
    max_num_seqs: int | None = None,
    num_blocks: int | None = None,
) -> Callable[[Sequence[SampledRequest]], tuple[int, float]]:
    """`baton.LLM` in this process, sized for `requests` (its max_model_len defaults to the
    longest) and warmed on a few of them, once; each call generates the requests it is given
    with it, greedy with ignore_eos: (output tokens, seconds). `max_num_seqs`: at most that
    many at a time, as the server had with `--max-concurrency`; `num_blocks`: a KV cache of
    that many blocks, the server's (a cache of another size is another engine: each block a
    request first writes costs the kernel a page to fill)."""
    from baton import LLM, SamplingParams  # lazy: the load generator itself needs no torch

    max_len = max_model_len or max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    caps: dict[str, int] = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    if num_blocks is not None:
        caps["num_gpu_blocks_override"] = num_blocks
    llm = LLM(model_path, max_model_len=max_len, **caps)

    def run(batch: Sequence[SampledRequest]) -> tuple[int, float]:
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in batch]
        params = [
            SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in batch
        ]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outputs), elapsed

    run(requests[:4])  # warm-up, as the server is warm by the time it is hit
    return run


def server_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user and system) so far of `pid` and of each of its descendants, by pid."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds: dict[int, float] = {}
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
            tasks = Path(f"/proc/{current}/task").iterdir()
            children = [int(c) for t in tasks for c in (t / "children").read_text().split()]
        except OSError:
            continue  # gone meanwhile
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        seconds[current] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        todo.extend(children)
    return seconds


# ---------------------------------------------------------------- CLI


def _cpus(text: str) -> set[int]:
    """CPU numbers from '0', '0,2' or '1-3'."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


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
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run this many rounds, each with prompts of its own; with --offline-baseline the "
        "server's run and the offline run alternate, and each ratio and their median are "
        "printed (a noisy machine moves between runs)",
    )
    p.add_argument("--json", type=Path, default=None, help="write every number to this file")
    p.add_argument(
        "--offline-baseline",
        action="store_true",
        help="also run baton.LLM offline on the same requests, --max-concurrency at most at a time",
    )
    p.add_argument("--model-path", default=None, help="model folder for --offline-baseline")
    p.add_argument("--max-model-len", type=int, default=None, help="for --offline-baseline")
    p.add_argument(
        "--client-cpus",
        type=_cpus,
        default=None,
        help="pin the load generator to these CPUs, e.g. 0 (start the server pinned elsewhere: "
        "taskset -c 1 baton engine ...)",
    )
    p.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="the local server's process (`baton engine`): print the CPU time it and its child "
        "processes (the EngineCore) spent over each run, and the API process's per output token",
    )
    p.add_argument(
        "--offline-cpus",
        type=_cpus,
        default=None,
        help="pin the offline baseline to these CPUs: the server's, so that the ratio is the "
        "server's overhead on the same compute",
    )
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
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    # Each round its own prompts: repeated ones would hit both engines' prefix caches.
    workloads = [workload(config, seed_offset=100 * i) for i in range(args.repeats)]
    offline_run: Callable[[Sequence[SampledRequest]], tuple[int, float]] | None = None
    rounds: list[dict[str, float]] = []
    for requests in workloads:  # the server, then the offline engine, alternated
        if args.client_cpus is not None:
            os.sched_setaffinity(0, args.client_cpus)
        before = server_cpu(args.server_pid) if args.server_pid is not None else None
        try:
            result = asyncio.run(run_benchmark(config, requests))
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(format_table(result))
        if before is not None:
            spent = {
                pid: cpu - before.get(pid, 0.0) for pid, cpu in server_cpu(args.server_pid).items()
            }
            print(format_server_cpu(spent, args.server_pid, result.metrics["total_output_tokens"]))
        if not args.offline_baseline:
            continue
        if args.offline_cpus is not None:  # before torch loads: its thread count follows
            os.sched_setaffinity(0, args.offline_cpus)
        if offline_run is None:
            every = [r for w in workloads for r in w]
            # The server's cache and length, so that both sides are the same engine.
            served_len, blocks = server_kv_cache(args.base_url)
            max_len = args.max_model_len or served_len
            said = f"KV blocks {blocks} (the server's)" if blocks else "KV blocks its own"
            print(f"Offline engine: max_model_len {max_len or 'the longest request'}, {said}")
            offline_run = offline_engine(
                args.model_path, every, max_len, args.max_concurrency, blocks
            )
        tokens, seconds = offline_run(requests)
        online_tput = result.metrics["output_throughput"]
        rounds.append(
            {
                "output_tokens": tokens,
                "duration": seconds,
                "output_throughput": tokens / seconds,
                "online_output_throughput": online_tput,
                "online_to_offline_ratio": online_tput * seconds / tokens,
            }
        )
        ratio = rounds[-1]["online_to_offline_ratio"]
        print(format_offline_baseline(tokens / seconds, online_tput, ratio))
    offline: dict[str, Any] | None = None
    if rounds:
        ratios = [r["online_to_offline_ratio"] for r in rounds]
        offline = {**rounds[-1], "online_to_offline_ratio": statistics.median(ratios)}
        if len(rounds) > 1:
            offline["rounds"] = rounds
            print(format_rounds(ratios))
    if args.json is not None:
        args.json.write_text(json.dumps(result_to_json(result, offline), indent=2))
    return 1 if result.metrics["completed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
