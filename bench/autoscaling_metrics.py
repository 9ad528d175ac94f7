"""Which engine metric should each pool's HPA scale on? A load ramp through `baton serve`
(1 prefill + 1 decode engine of the built-in `small` model, one torch thread each) that records,
step by step, every candidate the engines export and the latency clients see degrade.

Load is closed-loop: at each step `c` streams each send one streamed completion after another
(random token-id prompts of 512 +- 50% tokens, 128 +- 50% output tokens, `ignore_eos`, so no
prefix-cache hits and exact lengths). A step lets the new streams settle, then measures for
`--step-seconds`:

- candidates, per pool, from each engine's own /metrics scraped every second (no Prometheus):
  the gauges `vllm:num_requests_waiting`, `vllm:num_requests_running` and
  `vllm:kv_cache_usage_perc` averaged over the step's scrapes (what the adapter's
  `avg_over_time` gives), and the mean TTFT and ITL from their histograms' `_sum` and `_count`
  deltas over the step (what `rate(_sum) / rate(_count)` gives);
- what clients see: TTFT p50 and p90 of the first tokens that arrived in the step, the mean of
  the ITL gaps that ended in it, output tokens/s.

Each pool is judged against the latency it owns: prefill against client TTFT p90, decode against
client ITL mean. Per candidate: Spearman's rank correlation with that latency across the steps,
and how far it had risen (as a fraction of its range over the ramp, from its value at the first
step) at the first step where the latency exceeds twice its value at the first step: a metric
still flat there gives an HPA nothing to act on before users suffer. The choice: among the
candidates that had risen at least 5% by then (all, if none had), the highest correlation; within
0.05 of it, the one whose values are most nearly proportional to the offered load (Pearson's r
with the concurrency), since the HPA sizes a pool as replicas x value / target, which assumes
that. `--reanalyse` applies it again to the steps recorded in `--json`, without a ramp.

The KV cache is `--num-gpu-blocks-override 1024` blocks of 16 tokens on each engine (16,384
tokens): 32 streams of the mean length (640 tokens) would need more than the decode engine has,
as a GPU-sized cache would at the top of a real ramp, if the prefill engine kept up. On CPU a
decode step's time grows with the batch from the first stream on; on a GPU it stays flat longer,
so compare the shapes, not the absolute numbers.

    python bench/autoscaling_metrics.py [--concurrencies 1 2 4 6 8 12 16 24 32] [--step-seconds 13]
        [--json docs/results/autoscaling_metrics.json] [--plot docs/img/autoscaling_metrics.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

if not __package__:  # run as `python bench/autoscaling_metrics.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.disagg import Cluster, Setup
from bench.serve import SampledRequest, fetch_first_model, sample_random_requests, send_request

ROOT = Path(__file__).resolve().parents[1]
GAUGES = {
    "waiting": "vllm:num_requests_waiting",
    "running": "vllm:num_requests_running",
    "kv_usage": "vllm:kv_cache_usage_perc",
}
HISTOGRAMS = {
    "ttft_s": "vllm:time_to_first_token_seconds",
    "itl_s": "vllm:inter_token_latency_seconds",
}
CANDIDATES = (*GAUGES, *HISTOGRAMS)
# The latency each pool is responsible for, as the client sees it.
POOL_LATENCY = {"prefill": "ttft_p90_s", "decode": "itl_mean_s"}
TIE_RHO = 0.05  # correlations this close count as equal
MIN_RISE = 0.05  # a candidate must have risen this much of its range by the latency's crossing
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)")


@dataclass(frozen=True)
class RampConfig:
    """The ramp: concurrency per step, step timing, request lengths and the engines' KV cache."""

    concurrencies: tuple[int, ...] = (1, 2, 4, 6, 8, 12, 16, 24, 32)
    settle_s: float = 3.0  # after streams are added, before the step's measurement starts
    step_s: float = 13.0  # measured seconds per step
    input_len: int = 512
    output_len: int = 128
    range_ratio: float = 0.5  # lengths uniform in [len * (1 - r), len * (1 + r)]
    num_blocks: int = 1024  # KV blocks of 16 tokens per engine
    scrape_interval_s: float = 1.0
    warmup_s: float = 6.0  # two streams before the ramp, not measured
    drain_s: float = 60.0  # after the ramp, at most this long for requests in flight to end

    def __post_init__(self) -> None:
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError(f"concurrencies must be >= 1, got {self.concurrencies}")
        if list(self.concurrencies) != sorted(self.concurrencies):
            raise ValueError(f"concurrencies must ramp up, got {self.concurrencies}")
        if min(self.step_s, self.scrape_interval_s) <= 0 or self.settle_s < 0:
            raise ValueError("step and scrape interval must be > 0, settle >= 0")
        if min(self.input_len, self.output_len, self.num_blocks) < 1:
            raise ValueError("lengths and blocks must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")

    @property
    def max_model_len(self) -> int:
        """The longest request, rounded up to a multiple of 256."""
        longest = math.ceil((self.input_len + self.output_len) * (1 + self.range_ratio))
        return 256 * math.ceil(longest / 256)


# ---------------------------------------------------------------- engines' metrics


@dataclass(frozen=True)
class Scrape:
    """One scrape of every engine: when, and per pool the wanted series (summed over labels)."""

    at: float  # time.perf_counter()
    pools: dict[str, dict[str, float]]


def parse_metrics(text: str, names: set[str]) -> dict[str, float]:
    """The samples of Prometheus text whose name is in `names`, summed over their labels."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        found = _SAMPLE.match(line)
        if found and found[1] in names:
            values[found[1]] = values.get(found[1], 0.0) + float(found[2])
    return values


def _wanted_series() -> set[str]:
    return {*GAUGES.values()} | {
        f"{h}{end}" for h in HISTOGRAMS.values() for end in ("_sum", "_count")
    }


async def scrape_forever(
    client: httpx.AsyncClient, engines: dict[str, str], interval_s: float, into: list[Scrape]
) -> None:
    """Appends a Scrape of every engine (pool -> URL) every `interval_s` until cancelled."""
    names = _wanted_series()
    while True:
        started = time.perf_counter()
        pages = await asyncio.gather(*(client.get(f"{url}/metrics") for url in engines.values()))
        pools = {pool: parse_metrics(p.text, names) for pool, p in zip(engines, pages, strict=True)}
        into.append(Scrape(time.perf_counter(), pools))
        await asyncio.sleep(max(0.0, interval_s - (time.perf_counter() - started)))


def pool_candidates(
    scrapes: Sequence[Scrape], pool: str, start: float, end: float
) -> dict[str, float]:
    """One pool's candidates over [start, end]: gauges averaged over the scrapes in it, histogram
    means from the `_sum` and `_count` deltas between its first and last scrape (NaN if none)."""
    inside = [s.pools[pool] for s in scrapes if start <= s.at <= end]
    out: dict[str, float] = {}
    for key, name in GAUGES.items():
        out[key] = float(np.mean([s.get(name, math.nan) for s in inside])) if inside else math.nan
    for key, name in HISTOGRAMS.items():
        if len(inside) < 2:
            out[key] = math.nan
            continue
        first, last = inside[0], inside[-1]
        count = last.get(f"{name}_count", 0.0) - first.get(f"{name}_count", 0.0)
        total = last.get(f"{name}_sum", 0.0) - first.get(f"{name}_sum", 0.0)
        out[key] = total / count if count > 0 else math.nan
    return out


# ---------------------------------------------------------------- load


@dataclass
class Timeline:
    """What clients saw, as absolute times: first tokens, ITL gaps by when they ended, tokens."""

    first_tokens: list[tuple[float, float]] = field(default_factory=list)  # (at, ttft)
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (at, gap)
    token_times: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


class Ramp:
    """Closed-loop streams against one router: `grow(c)` starts streams until `c` run; each sends
    its next request as soon as its last one ends, until `stop()`."""

    def __init__(
        self, client: httpx.AsyncClient, url: str, model: str, requests: list[SampledRequest]
    ) -> None:
        self._client, self._url, self._model = client, f"{url}/v1/completions", model
        self._requests = requests
        self._next = 0
        self._stopping = False
        self._streams: list[asyncio.Task[None]] = []
        self.timeline = Timeline()

    def grow(self, concurrency: int) -> None:
        while len(self._streams) < concurrency:
            self._streams.append(asyncio.create_task(self._stream()))

    async def stop(self, drain_s: float) -> None:
        """No new requests; waits up to `drain_s` for those in flight, then cancels them."""
        self._stopping = True
        _, pending = await asyncio.wait(self._streams, timeout=drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _stream(self) -> None:
        while not self._stopping:
            request = self._requests[self._next % len(self._requests)]
            self._next += 1
            sent = time.perf_counter()
            record = await send_request(self._client, self._url, self._model, request)
            if not record.success:
                self.timeline.failures.append(record.error or "unknown")
                continue
            at = sent + record.ttft
            self.timeline.first_tokens.append((at, record.ttft))
            self.timeline.token_times.append(at)
            for gap in record.itl:
                at += gap
                self.timeline.gaps.append((at, gap))
                self.timeline.token_times.append(at)


def client_latency(timeline: Timeline, start: float, end: float) -> dict[str, float]:
    """Client TTFT p50/p90 of first tokens in [start, end), mean of ITL gaps ending in it, and
    output tokens/s."""
    ttfts = [t for at, t in timeline.first_tokens if start <= at < end]
    gaps = [g for at, g in timeline.gaps if start <= at < end]
    tokens = sum(start <= at < end for at in timeline.token_times)
    return {
        "ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts else math.nan,
        "ttft_p90_s": float(np.percentile(ttfts, 90)) if ttfts else math.nan,
        "itl_mean_s": float(np.mean(gaps)) if gaps else math.nan,
        "output_tok_s": tokens / (end - start),
        "first_tokens": len(ttfts),
    }


async def run_ramp(
    url: str, engines: dict[str, str], config: RampConfig, vocab_size: int
) -> tuple[list[dict[str, Any]], int]:
    """The ramp against `url`; one row per step (client latency and each pool's candidates), and
    the number of failed requests."""
    top = max(config.concurrencies)
    limits = httpx.Limits(
        max_connections=top + len(engines), max_keepalive_connections=top + len(engines)
    )
    timeout = httpx.Timeout(300.0, connect=30.0, pool=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        model = await fetch_first_model(client, url)
        requests = sample_random_requests(
            4000, config.input_len, config.output_len, config.range_ratio, vocab_size, seed=0
        )
        warmup = Ramp(client, url, model, requests[::-1])  # prompts no measured one repeats
        warmup.grow(2)
        await asyncio.sleep(config.warmup_s)
        await warmup.stop(config.drain_s)

        scrapes: list[Scrape] = []
        scraper = asyncio.create_task(
            scrape_forever(client, engines, config.scrape_interval_s, scrapes)
        )
        ramp = Ramp(client, url, model, requests)
        windows = []
        for concurrency in config.concurrencies:
            ramp.grow(concurrency)
            await asyncio.sleep(config.settle_s)
            start = time.perf_counter()
            await asyncio.sleep(config.step_s)
            windows.append((concurrency, start, time.perf_counter()))
            print(f"step {concurrency:>3} streams done, load {os.getloadavg()[0]:.2f}", flush=True)
        await ramp.stop(config.drain_s)
        if scraper.done():
            scraper.result()  # raises what stopped the scrapes early
        scraper.cancel()
        await asyncio.gather(scraper, return_exceptions=True)
    rows = [
        {
            "concurrency": c,
            "client": client_latency(ramp.timeline, start, end),
            "pools": {pool: pool_candidates(scrapes, pool, start, end) for pool in engines},
        }
        for c, start, end in windows
    ]
    return rows, len(ramp.timeline.failures)


# ---------------------------------------------------------------- analysis


def rank(values: Sequence[float]) -> np.ndarray:
    """Ranks from 1, ties given the mean of the ranks they span (as Spearman's rho needs)."""
    x = np.asarray(values, dtype=float)
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(1, len(x) + 1)
    for value in np.unique(x):
        tied = x == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation over the pairs where both are finite; NaN if either is
    constant there or fewer than three pairs remain."""
    pairs = [(a, b) for a, b in zip(x, y, strict=True) if math.isfinite(a) and math.isfinite(b)]
    if len(pairs) < 3:
        return math.nan
    rx, ry = rank([a for a, _ in pairs]), rank([b for _, b in pairs])
    if rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson's r over the pairs where both are finite; NaN if either is constant there."""
    pairs = np.asarray([(a, b) for a, b in zip(x, y, strict=True) if math.isfinite(a + b)])
    if len(pairs) < 3 or pairs[:, 0].std() == 0 or pairs[:, 1].std() == 0:
        return math.nan
    return float(np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1])


def crossing(latency: Sequence[float], factor: float = 2.0) -> int | None:
    """The first step whose latency exceeds `factor` times the first step's; None if none does."""
    return next((i for i, v in enumerate(latency) if v > factor * latency[0]), None)


def rise_at(values: Sequence[float], step: int | None) -> float:
    """How far `values` had risen from the first step by `step`, as a fraction of its rise to its
    highest value over the ramp (0: still at its unloaded value; 1: already at its top)."""
    finite = [v for v in values if math.isfinite(v)]
    if (
        step is None
        or not finite
        or not math.isfinite(values[0])
        or not math.isfinite(values[step])
    ):
        return math.nan
    span = max(finite) - values[0]
    return (values[step] - values[0]) / span if span > 0 else math.nan


def analyse(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per pool: each candidate's correlation with the pool's latency and its rise at the step
    where that latency doubled, and the candidate chosen by them."""
    out: dict[str, Any] = {}
    for pool, latency_key in POOL_LATENCY.items():
        latency = [r["client"][latency_key] for r in rows]
        cross = crossing(latency)
        scores = {}
        for candidate in CANDIDATES:
            values = [r["pools"][pool][candidate] for r in rows]
            scores[candidate] = {
                "spearman": spearman(values, latency),
                "spearman_ttft_p90": spearman(values, [r["client"]["ttft_p90_s"] for r in rows]),
                "spearman_itl_mean": spearman(values, [r["client"]["itl_mean_s"] for r in rows]),
                "value_at_crossing": values[cross] if cross is not None else math.nan,
                "rise_at_crossing": rise_at(values, cross),
                "pearson_load": pearson(values, [float(r["concurrency"]) for r in rows]),
            }
        out[pool] = {
            "latency": latency_key,
            "crossing_concurrency": rows[cross]["concurrency"] if cross is not None else None,
            "candidates": scores,
            **choose(scores),
        }
    return out


def choose(scores: dict[str, dict[str, float]]) -> dict[str, Any]:
    """`chosen`: among the candidates risen by MIN_RISE at the crossing (all, if none is), the
    highest correlation, or among those within TIE_RHO of it (`tied`, the others), the most
    proportional to the load; None when no candidate correlates at all."""
    rated = {k: s for k, s in scores.items() if math.isfinite(s["spearman"])}
    pool = {k: s for k, s in rated.items() if s["rise_at_crossing"] >= MIN_RISE} or rated
    if not pool:
        return {"chosen": None, "tied": []}
    best = max(s["spearman"] for s in pool.values())
    close = [k for k, s in pool.items() if s["spearman"] >= best - TIE_RHO]

    def proportional(k: str) -> float:
        r = pool[k]["pearson_load"]
        return r if math.isfinite(r) else -math.inf

    chosen = max(close, key=lambda k: (proportional(k), pool[k]["spearman"]))
    return {"chosen": chosen, "tied": [k for k in close if k != chosen]}


# ---------------------------------------------------------------- report


def _cell(value: float, scale: float = 1.0, width: int = 8, digits: int = 1) -> str:
    return f"{'-':>{width}}" if not math.isfinite(value) else f"{value * scale:>{width}.{digits}f}"


def format_steps(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        f"{'':>4} | {'client':^35} | {'prefill engine':^35} | {'decode engine':^44}\n"
        f"{'c':>4} | {'TTFTp50':>8}{'TTFTp90':>9}{'ITL':>9}{'tok/s':>9} | "
        f"{'wait':>8}{'run':>8}{'KV%':>8}{'TTFT':>11} | "
        f"{'wait':>8}{'run':>8}{'KV%':>8}{'TTFT':>11}{'ITL':>9}\n"
        f"{'':>4} | {'ms':>8}{'ms':>9}{'ms':>9}{'':>9} | {'':>24}{'ms':>11} | "
        f"{'':>24}{'ms':>11}{'ms':>9}"
    )
    lines = [head]
    for r in rows:
        c, p, d = r["client"], r["pools"]["prefill"], r["pools"]["decode"]
        lines.append(
            f"{r['concurrency']:>4} | {_cell(c['ttft_p50_s'], 1e3)}{_cell(c['ttft_p90_s'], 1e3, 9)}"
            f"{_cell(c['itl_mean_s'], 1e3, 9)}{_cell(c['output_tok_s'], 1, 9, 0)} | "
            f"{_cell(p['waiting'])}{_cell(p['running'])}{_cell(p['kv_usage'], 100)}"
            f"{_cell(p['ttft_s'], 1e3, 11)} | "
            f"{_cell(d['waiting'])}{_cell(d['running'])}{_cell(d['kv_usage'], 100)}"
            f"{_cell(d['ttft_s'], 1e3, 11)}{_cell(d['itl_s'], 1e3, 9)}"
        )
    return "\n".join(lines)


def format_analysis(analysis: dict[str, Any]) -> str:
    lines = []
    for pool, a in analysis.items():
        cross = a["crossing_concurrency"]
        lines.append(
            f"-- {pool} pool, against client {a['latency']} (2x its unloaded value first at "
            f"{'no step' if cross is None else f'{cross} streams'})"
        )
        lines.append(
            f"   {'candidate':<10}{'rho':>7}{'rho TTFT':>10}{'rho ITL':>9}{'at 2x':>10}"
            f"{'risen':>8}{'r load':>8}"
        )
        for name, s in a["candidates"].items():
            mark = "  <- chosen" if name == a["chosen"] else ""
            lines.append(
                f"   {name:<10}{_cell(s['spearman'], 1, 7, 2)}"
                f"{_cell(s['spearman_ttft_p90'], 1, 10, 2)}"
                f"{_cell(s['spearman_itl_mean'], 1, 9, 2)}{_cell(s['value_at_crossing'], 1, 10, 3)}"
                f"{_cell(s['rise_at_crossing'], 100, 7, 0)}%{_cell(s['pearson_load'], 1, 8, 2)}"
                f"{mark}"
            )
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], analysis: dict[str, Any], path: Path) -> bool:
    """Each pool's candidates (normalised to their top) and its latency against concurrency;
    False (and nothing drawn) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    x = [r["concurrency"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, (pool, a) in zip(axes, analysis.items(), strict=True):
        latency = [r["client"][a["latency"]] for r in rows]
        ax.plot(
            x,
            np.asarray(latency) / np.nanmax(latency),
            "k--",
            linewidth=2,
            label=f"client {a['latency']}",
        )
        for name in CANDIDATES:
            values = np.asarray([r["pools"][pool][name] for r in rows])
            if np.isfinite(values).any() and np.nanmax(values) > 0:
                width = 3 if name == a["chosen"] else 1.2
                ax.plot(x, values / np.nanmax(values), marker="o", linewidth=width, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(f"{pool} engine (chosen: {a['chosen']})")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("fraction of its highest value")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    c = RampConfig()
    p.add_argument("--concurrencies", type=int, nargs="+", default=list(c.concurrencies))
    p.add_argument("--step-seconds", type=float, default=c.step_s)
    p.add_argument("--settle-seconds", type=float, default=c.settle_s)
    p.add_argument("--input-len", type=int, default=c.input_len)
    p.add_argument("--output-len", type=int, default=c.output_len)
    p.add_argument("--num-blocks", type=int, default=c.num_blocks, help="KV blocks per engine")
    p.add_argument(
        "--model", type=Path, default=None, help="model folder (default: built-in small)"
    )
    p.add_argument("--json", type=Path, default=ROOT / "docs/results/autoscaling_metrics.json")
    p.add_argument("--plot", type=Path, default=ROOT / "docs/img/autoscaling_metrics.png")
    p.add_argument(
        "--reanalyse", action="store_true", help="no ramp: analyse the steps in --json again"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.reanalyse:
        summary = json.loads(args.json.read_text(), object_hook=_none_to_nan)
        report(summary | {"analysis": analyse(summary["steps"])}, args.json, args.plot)
        return 0
    config = RampConfig(
        concurrencies=tuple(args.concurrencies),
        step_s=args.step_seconds,
        settle_s=args.settle_seconds,
        input_len=args.input_len,
        output_len=args.output_len,
        num_blocks=args.num_blocks,
    )
    if args.model is None:
        from baton.engine.models.tiny import default_model_path  # writes the model on first use

        args.model = default_model_path()
    vocab_size = int(json.loads((args.model / "config.json").read_text())["vocab_size"])
    engine_args = [
        "--model", str(args.model), "--max-model-len", str(config.max_model_len),
        "--num-gpu-blocks-override", str(config.num_blocks),
    ]  # fmt: skip
    load_before = os.getloadavg()
    started = time.monotonic()
    cluster = Cluster(
        Setup("disagg", ("--prefill", "1", "--decode", "1")),
        engine_args,
        Path(tempfile.mkdtemp(prefix="baton-autoscaling-")),
    )
    try:
        cluster.wait_ready()
        listed = httpx.get(f"{cluster.url}/engines", timeout=10).json()["engines"]
        engines = {e["role"]: e["url"] for e in listed}
        if set(engines) != {"prefill", "decode"}:
            raise RuntimeError(f"expected one prefill and one decode engine: {listed}")
        rows, failed = asyncio.run(run_ramp(cluster.url, engines, config, vocab_size))
    finally:
        cluster.stop()
    summary = {
        "config": asdict(config),
        "engine_args": engine_args,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "seconds": time.monotonic() - started,
        "failed_requests": failed,
        "steps": rows,
        "analysis": analyse(rows),
    }
    report(summary, args.json, args.plot)
    return 1 if failed else 0


def report(summary: dict[str, Any], json_path: Path, plot_path: Path) -> None:
    """Prints the steps, the analysis and the choices; writes the JSON and the plot."""
    rows, analysis = summary["steps"], summary["analysis"]
    print(
        f"load average before {summary['load_average_before'][0]:.2f}, after "
        f"{summary['load_average_after'][0]:.2f} (1 min); {summary['seconds']:.0f} s; "
        f"{summary['failed_requests']} failed requests"
    )
    print(format_steps(rows))
    print(format_analysis(analysis))
    for pool, a in analysis.items():
        rho = a["candidates"][a["chosen"]]["spearman"] if a["chosen"] else math.nan
        line = f"{pool}: scale on {a['chosen']} (rho {rho:.2f})"
        if a["tied"]:
            others = ", ".join(f"{k} {a['candidates'][k]['spearman']:.2f}" for k in a["tied"])
            line += (
                f"; tied within {TIE_RHO} with {others}: chosen as the most proportional to load"
            )
        print(line)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(_nan_to_none(summary), indent=2) + "\n")
    if not plot(rows, analysis, plot_path):
        print(f"matplotlib is not installed: no plot at {plot_path} (pip install matplotlib)")


def _none_to_nan(obj: dict[str, Any]) -> dict[str, Any]:
    """JSON's null back to the NaN it was written for (a JSON object hook)."""
    return {k: math.nan if v is None else v for k, v in obj.items()}


def _nan_to_none(value: Any) -> Any:
    """NaN as null, which JSON has (it has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_nan_to_none(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
