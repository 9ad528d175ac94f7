"""Metrics and report of the online serving benchmark (`bench/serve.py`).

Pure functions of what the client saw of each request; the metric definitions, which follow
`vllm bench serve`, are in `bench/serve.py`'s docstring.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from bench.serve import BenchmarkResult

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILE = 99.0


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


def check_slos(slos_ms: Mapping[str, float]) -> None:
    """Raises ValueError unless every SLO names a known metric and a positive bound in ms."""
    for name, bound in slos_ms.items():
        if name not in SLO_METRICS:
            raise ValueError(f"unknown SLO metric {name!r}; choose from {', '.join(SLO_METRICS)}")
        if not bound > 0:
            raise ValueError(f"SLO {name} must be a positive number of ms, got {bound}")


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


# ---------------------------------------------------------------- report

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


def format_rounds(ratios: Sequence[float]) -> str:
    """The ratios of alternated rounds (`--repeats`) and their median."""
    return "\n".join(
        [
            _banner(f" Online / offline over {len(ratios)} alternated rounds ", "="),
            _row("Each round:", ", ".join(f"{r:.3f}" for r in ratios)),
            _row("Median (goal >= 0.90 at 64):", statistics.median(ratios)),
            "=" * _WIDTH,
        ]
    )


def format_server_cpu(spent: Mapping[int, float], api_pid: int, output_tokens: int) -> str:
    """The CPU seconds a local server's processes spent over a run (`--server-pid`): its API
    process, the others (its EngineCore), and the API's per output token."""
    api = spent.get(api_pid, 0.0)
    others = sum(cpu for pid, cpu in spent.items() if pid != api_pid)
    per_token = api / output_tokens * 1e6 if output_tokens else math.nan
    return "\n".join(
        [
            _banner(" Server CPU over the run ", "-"),
            _row("API process CPU (s):", api),
            _row("Its child processes' CPU (s):", others),
            _row("API CPU per output token (us):", per_token),
        ]
    )


def format_offline_baseline(offline_tput: float, online_tput: float, ratio: float) -> str:
    """The offline-baseline block printed after the report, in the same layout."""
    return "\n".join(
        [
            _banner(" Offline Baseline (baton.LLM) ", "="),
            _row("Offline output throughput (tok/s):", offline_tput),
            _row("Online output throughput (tok/s):", online_tput),
            _row("Online / offline (goal >= 0.90 at 64):", ratio),
            "=" * _WIDTH,
        ]
    )
