"""The SLO planner against fixed pools and per-pool HPAs, in a discrete-event simulation of one
disaggregated service over a day.

The engines are this machine's `baton serve` engines of the `small` model, as `--calibrate`
measures them (1 prefill + 1 decode engine, one torch thread each) and writes them to
docs/results/planner_calibration.json, so the simulation runs without a server:

- a prefill engine is a FIFO queue; a prompt of P tokens takes fixed + per_token * P +
  per_token_squared * P^2 (attention grows with the square of the prompt), and the router sends
  each request to the ready engine that frees first;
- the hand-off to decode takes the overhead measured between the end-to-end TTFT and the
  prefill engine's own;
- a decode engine batches its streams: a step of B streams takes step_fixed + per_stream * B
  and gives each a token (processor sharing, one event per join and departure); it admits a
  stream while it has fewer than max_num_seqs and room in its KV cache.

The trace is a day (or the day's shape compressed into `--hours`): Poisson arrivals at night,
rising through the morning, a plateau from 11:00 to 14:00 with bursts of 1.3-1.6x lasting 2-8
minutes, falling in the evening; prompts and outputs log-normal. Three policies run on it:
fixed pools sized for the peak (the most engines the planner asked for), per-pool HPAs on
today's engine metrics (prefill on vllm:num_requests_waiting, average target 4; decode on
vllm:kv_cache_usage_perc, target 0.8; Kubernetes' algorithm with a 15 s sync and a 5-minute
scale-down stabilisation), and `baton.operator.planner`. New engines start after `--startup`
seconds for every policy. Each reports the share of 60 s intervals with TTFT p90 and mean ITL
within the targets (twice what the trace's requests see on idle engines) and its engine-hours.
Aim (issue 21): the planner meets both targets in >= 99% of intervals on >= 30% fewer
engine-hours than peak sizing.

    python bench/planner_sim.py --calibrate    # ~2 min: measures, writes the calibration
    python bench/planner_sim.py [--hours 24] [--peak-rate 8] [--startup 60] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import heapq
import itertools
import json
import math
import os
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx
import numpy as np

if not __package__:  # run as `python bench/planner_sim.py`: make the `bench` folder importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.operator.planner import Observation, Planner, PlannerConfig
from baton.operator.spec import PlannerSpec

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION_PATH = ROOT / "docs" / "results" / "planner_calibration.json"

# ---------------------------------------------------------------- calibration (--calibrate)

# The engines of the calibration run. The KV budget (256 MiB: 65,536 tokens of the `small`
# model) holds ~50 streams of the trace's mean context, so KV usage means something to an HPA.
CAL_KV_CACHE_BYTES = 256 << 20
CAL_MAX_MODEL_LEN = 4096
CAL_PREFILL_LENGTHS = (128, 512, 1024, 2048, 3072)
CAL_PREFILL_REPEATS = 4
CAL_DECODE_BATCHES = (1, 2, 4, 8, 16, 24, 32)
CAL_DECODE_PROMPT = 1024  # about the trace's mean prompt: decode steps slow down with context
CAL_DECODE_OUTPUT = 384
CAL_MIN_GAPS = 50  # a batch size seen for fewer gaps is left out of the fit


def _samples(text: str, name: str) -> list[tuple[str, float]]:
    """(labels, value) of every sample of metric `name` in Prometheus text."""
    out = []
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in "{ ":
            series, _, value = line.rpartition(" ")
            out.append((series[len(name) :], float(value)))
    return out


def _label(labels: str, key: str) -> str:
    return labels.split(f'{key}="', 1)[1].split('"', 1)[0]


def _fit_line(
    xs: Sequence[float], ys: Sequence[float], counts: Sequence[int] | None = None
) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points, each point weighted by
    the number of samples it is the median of, if given."""
    weights = None if counts is None else np.sqrt(np.asarray(counts, float))  # polyfit squares
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1, w=weights)
    return float(intercept), float(slope)


async def _calibrate_async(url: str, prefill_url: str, vocab: int) -> dict[str, Any]:
    """The raw measurements through the router at `url`: (prompt tokens, prefill engine TTFT,
    end-to-end TTFT) per prefill request, (streams running, median gap, gaps) per batch size."""
    from bench.serve import fetch_first_model, sample_random_requests, send_request

    timeout = httpx.Timeout(300.0, connect=30.0, pool=None)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = await fetch_first_model(client, url)
        completions = f"{url}/v1/completions"

        async def prefill_ttft() -> tuple[float, float]:
            text = (await client.get(f"{prefill_url}/metrics")).text
            total = sum(v for _, v in _samples(text, "vllm:time_to_first_token_seconds_sum"))
            count = sum(v for _, v in _samples(text, "vllm:time_to_first_token_seconds_count"))
            return total, count

        for request in sample_random_requests(4, 512, 8, 0.0, vocab, seed=99):  # warm-up
            await send_request(client, completions, model, request)
        prefill_rows = []
        for n, length in enumerate(CAL_PREFILL_LENGTHS):
            for request in sample_random_requests(
                CAL_PREFILL_REPEATS, length, 4, 0.0, vocab, seed=n
            ):
                sum0, count0 = await prefill_ttft()
                record = await send_request(client, completions, model, request)
                sum1, count1 = await prefill_ttft()
                if not record.success or count1 <= count0:
                    raise RuntimeError(f"prefill calibration request failed: {record.error}")
                prefill_rows.append((length, (sum1 - sum0) / (count1 - count0), record.ttft))

        # Gaps between tokens by how many streams ran then. The streams of a batch join one
        # by one as the prefill engine gets to them, and prefill takes CPU from the decode
        # engine: only gaps after the batch's last first token count.
        async def timed(request: Any) -> tuple[float, Any]:
            start = time.perf_counter()
            return start, await send_request(client, completions, model, request)

        gaps: dict[int, list[float]] = {}
        for n, batch in enumerate(CAL_DECODE_BATCHES):
            requests = sample_random_requests(
                batch, CAL_DECODE_PROMPT, CAL_DECODE_OUTPUT, 0.0, vocab, seed=100 + n
            )
            done = await asyncio.gather(*(timed(r) for r in requests))
            if not all(r.success for _, r in done):
                raise RuntimeError("decode calibration request failed")
            spans = [(s + r.ttft, s + r.latency) for s, r in done]
            joined = max(first for first, _ in spans)
            for s, r in done:
                t = s + r.ttft
                for gap in r.itl:
                    if t >= joined:
                        mid = t + gap / 2
                        running = sum(a <= mid <= b for a, b in spans)
                        gaps.setdefault(running, []).append(gap)
                    t += gap
        decode_rows = [
            (streams, float(np.median(g)), len(g))
            for streams, g in sorted(gaps.items())
            if len(g) >= CAL_MIN_GAPS
        ]
    return {"model": model, "prefill": prefill_rows, "decode": decode_rows}


def calibrate(out: Path) -> dict[str, Any]:
    """Starts `baton serve --prefill 1 --decode 1` of the `small` model, measures prefill time
    per prompt token, the hand-off's overhead and the decode step time per batch size (the
    median gap between tokens while that many streams run), and writes them to `out`."""
    from baton.engine.models.tiny import default_model_path
    from bench.disagg import Cluster, Setup

    model_path = default_model_path()
    vocab = int(json.loads((model_path / "config.json").read_text())["vocab_size"])
    engine_args = [
        "--model", str(model_path), "--max-model-len", str(CAL_MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(CAL_KV_CACHE_BYTES),
    ]  # fmt: skip
    load_before = os.getloadavg()[0]
    cluster = Cluster(
        Setup("calibrate", ("--prefill", "1", "--decode", "1")),
        engine_args,
        Path(tempfile.mkdtemp(prefix="baton-planner-cal-")),
    )
    try:
        cluster.wait_ready()
        engines = {
            _label(labels, "role"): _label(labels, "engine")
            for labels, _ in _samples(
                httpx.get(f"{cluster.url}/metrics", timeout=5).text, "baton:router_engine_healthy"
            )
        }
        decode_metrics = httpx.get(f"{engines['decode']}/metrics", timeout=5).text
        cache = _samples(decode_metrics, "vllm:cache_config_info")[0][0]
        kv_tokens = int(_label(cache, "num_gpu_blocks")) * int(_label(cache, "block_size"))
        max_num_seqs = 256  # `baton engine`'s default, which the run keeps
        raw = asyncio.run(_calibrate_async(cluster.url, engines["prefill"], vocab))
    finally:
        cluster.stop()
    # Fits through the median of each prompt length: one slow request on a busy machine
    # moves a median less than a mean.
    lengths = CAL_PREFILL_LENGTHS
    by_length = [[row for row in raw["prefill"] if row[0] == n] for n in lengths]
    engine_s = [float(np.median([row[1] for row in rows])) for rows in by_length]
    overhead = [float(np.median([row[2] - row[1] for row in rows])) for rows in by_length]
    prefill_squared, prefill_per_token, prefill_fixed = np.polyfit(lengths, engine_s, 2)
    handoff_fixed, handoff_per_token = _fit_line(lengths, overhead)
    streams, step_s, gaps = zip(*raw["decode"], strict=True)
    step_fixed, step_per_stream = _fit_line(streams, step_s, gaps)
    result = {
        "command": "python bench/planner_sim.py --calibrate",
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} CPUs, load average {load_before:.2f} before the run",
        "serve_args": ["--prefill", "1", "--decode", "1", *engine_args[2:]],
        "kv_capacity_tokens": kv_tokens,
        "max_num_seqs": max_num_seqs,
        "prefill_fixed_s": float(prefill_fixed),
        "prefill_per_token_s": float(prefill_per_token),
        "prefill_per_token_squared_s": float(prefill_squared),
        "handoff_fixed_s": handoff_fixed,
        "handoff_per_token_s": handoff_per_token,
        "decode_step_fixed_s": step_fixed,
        "decode_step_per_stream_s": step_per_stream,
        "decode_context": {"prompt": CAL_DECODE_PROMPT, "output": CAL_DECODE_OUTPUT},
        "points": {
            "prefill (prompt tokens, prefill engine TTFT s, end-to-end TTFT s)": raw["prefill"],
            "decode (streams running, median gap s, gaps)": raw["decode"],
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


# ---------------------------------------------------------------- the engines and the trace


@dataclass(frozen=True)
class EngineModel:
    """Service times of one engine of this machine, from the calibration (seconds)."""

    prefill_fixed_s: float
    prefill_per_token_s: float
    handoff_fixed_s: float  # end-to-end TTFT less the prefill engine's, unloaded
    handoff_per_token_s: float
    decode_step_fixed_s: float
    decode_step_per_stream_s: float
    kv_capacity_tokens: int
    max_num_seqs: int
    prefill_per_token_squared_s: float = 0.0  # attention's share, quadratic in the prompt

    @classmethod
    def from_calibration(cls, cal: dict[str, Any]) -> EngineModel:
        return cls(**{f.name: cal[f.name] for f in fields(cls)})

    def prefill_s(self, prompt: int) -> float:
        linear = self.prefill_fixed_s + self.prefill_per_token_s * prompt
        return max(0.0, linear + self.prefill_per_token_squared_s * prompt * prompt)

    def handoff_s(self, prompt: int) -> float:
        """From the prefill's end to joining a decode batch: the measured overhead less the
        first decode step, which the simulation adds at the batch size it finds."""
        overhead = self.handoff_fixed_s + self.handoff_per_token_s * prompt
        return max(0.0, overhead - self.step_s(1))

    def step_s(self, streams: int) -> float:
        return self.decode_step_fixed_s + self.decode_step_per_stream_s * streams


@dataclass(frozen=True)
class TraceConfig:
    """A day of requests: `_day_share` compressed into `hours`, Poisson arrivals at `peak_rate`
    times the share, with bursts at midday; lengths log-normal and clipped."""

    hours: float = 24.0
    peak_rate: float = 8.0  # requests/s at midday, before bursts
    night_share: float = 0.08  # the night's rate over the peak
    bursts_per_hour: float = 3.0  # at random times between 11:00 and 14:00 of the shape
    burst_factor: tuple[float, float] = (1.3, 1.6)  # the rate times this much...
    burst_minutes: tuple[float, float] = (2.0, 8.0)  # ... for this long (real minutes)
    prompt_mean: float = 1024.0
    prompt_sigma: float = 0.6
    prompt_range: tuple[int, int] = (32, 3072)
    output_mean: float = 256.0
    output_sigma: float = 0.6
    output_range: tuple[int, int] = (8, 1000)
    seed: int = 0


def _day_share(hour: np.ndarray, night: float) -> np.ndarray:
    """The rate over the peak at each hour of the day: night until 6:00, rising through the
    morning, the peak from 11:00 to 14:00, falling in the evening; knots joined by half
    cosines."""
    knots = [(0, night), (6, night), (9.5, 0.8), (11, 1.0), (14, 1.0), (17, 0.8), (21, 0.3)]
    knots += [(23, night), (24, night)]
    out = np.empty_like(hour)
    for (h0, v0), (h1, v1) in itertools.pairwise(knots):
        inside = (hour >= h0) & (hour < h1)
        phase = (hour[inside] - h0) / (h1 - h0)
        out[inside] = v0 + (v1 - v0) * (1 - np.cos(np.pi * phase)) / 2
    return out


@dataclass(frozen=True)
class Trace:
    """The requests of one run, and the rate they were drawn at."""

    arrival: np.ndarray  # [n] seconds, sorted
    prompt: np.ndarray  # [n] tokens
    output: np.ndarray  # [n] tokens
    rate: np.ndarray  # [seconds] the Poisson rate of each second
    duration_s: float


def make_trace(c: TraceConfig) -> Trace:
    """Draws the trace: a Poisson count per second at that second's rate, spread uniformly."""
    rng = np.random.default_rng(c.seed)
    duration = c.hours * 3600.0
    seconds = np.arange(int(duration)) + 0.5
    rate = c.peak_rate * _day_share(seconds * 24.0 / duration, c.night_share)
    midday = (11 / 24 * duration, 14 / 24 * duration)
    burst = np.ones_like(rate)  # overlapping bursts do not compound: the larger one counts
    for _ in range(round(c.bursts_per_hour * (midday[1] - midday[0]) / 3600)):
        start = rng.uniform(*midday)
        length = rng.uniform(*c.burst_minutes) * 60
        ramp = 30.0  # seconds up and down
        level = np.clip(np.minimum(seconds - start, start + length - seconds) / ramp, 0, 1)
        burst = np.maximum(burst, 1 + (rng.uniform(*c.burst_factor) - 1) * level)
    rate *= burst
    counts = rng.poisson(rate)
    arrival = np.sort(np.repeat(seconds - 0.5, counts) + rng.random(counts.sum()))

    def lengths(mean: float, sigma: float, bounds: tuple[int, int]) -> np.ndarray:
        drawn = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, size=len(arrival))
        return np.clip(np.rint(drawn), *bounds).astype(np.int64)

    prompt = lengths(c.prompt_mean, c.prompt_sigma, c.prompt_range)
    output = lengths(c.output_mean, c.output_sigma, c.output_range)
    return Trace(arrival, prompt, output, rate, duration)


def slo_targets(engine: EngineModel, trace: Trace) -> tuple[float, float]:
    """(TTFT p90, ITL mean) targets: twice what the trace's requests see with no other load."""
    unloaded = [engine.prefill_s(p) + engine.handoff_s(p) for p in trace.prompt[:20_000]]
    ttft = float(np.percentile(unloaded, 90)) + engine.step_s(1)
    return 2 * ttft, 2 * engine.step_s(1)


# ---------------------------------------------------------------- the simulation

BIN_S = 15.0  # the HPA's sync period; the planner's interval and the SLO's are multiples of it
SLO_INTERVAL_S = 60.0
MAX_ENGINES = 32  # each pool's bound, for the planner and the HPAs alike
# Every policy starts with its smallest pools and the planner knows nothing yet: the first
# minutes are not scored (their engine-hours are counted).
WARMUP_S = 300.0
_JOIN, _DEPART = 0, 1


class Engine:
    """What every engine has: when it is ready (start-up done) and whether it drains."""

    __slots__ = ("draining", "ready_at")

    def __init__(self, ready_at: float) -> None:
        self.ready_at = ready_at
        self.draining = False  # takes no new work, ends when its work is done

    def backlog(self) -> float:
        """How much work the engine holds; of the engines that serve, the least loaded drain
        first."""
        raise NotImplementedError


class PrefillEngine(Engine):
    """A prefill engine as a FIFO queue: a request starts once the engine is free and takes
    `prefill_s(prompt)`; the router sends each request to the ready engine that frees first."""

    __slots__ = ("free_at", "starts")

    def __init__(self, ready_at: float) -> None:
        super().__init__(ready_at)
        self.free_at = ready_at
        self.starts: deque[float] = deque()  # start times still ahead: the waiting requests

    def backlog(self) -> float:
        return self.free_at

    def waiting(self, now: float) -> int:
        while self.starts and self.starts[0] <= now:
            self.starts.popleft()
        return len(self.starts)


class DecodeEngine(Engine):
    """A decode engine as processor sharing: a step of B streams takes `step_s(B)` and gives each
    stream a token. `clock` counts steps, so a stream that joined at clock c wanting n tokens
    ends when the clock reaches c + n, whatever the batch did meanwhile: one event per join and
    per departure, not one per step."""

    __slots__ = ("clock", "finish", "join_sum", "last", "prompt_sum", "version", "waiting")

    def __init__(self, ready_at: float) -> None:
        super().__init__(ready_at)
        self.last = ready_at
        self.clock = 0.0
        self.finish: list[tuple[float, float, int]] = []  # heap: (end clock, join clock, request)
        self.prompt_sum = 0  # prompt tokens of the running streams
        self.join_sum = 0.0  # their join clocks: generated tokens = B * clock - join_sum
        self.version = 0  # bumped when the next departure moves; older events are stale
        self.waiting: deque[int] = deque()  # requests the engine had no room for yet

    def kv_tokens(self) -> float:
        return self.prompt_sum + len(self.finish) * self.clock - self.join_sum

    def load(self) -> int:
        return len(self.finish) + len(self.waiting)

    def backlog(self) -> float:
        return self.load()


class Policy(Protocol):
    name: str
    period_s: float  # how often `tick` runs: a multiple of BIN_S, or inf

    def start(self) -> tuple[int, int]: ...
    def tick(self, sim: Simulation, now: float) -> tuple[int, int]: ...


class Simulation:
    """One policy over one trace. Measures in bins of BIN_S seconds what Prometheus would see:
    counters by when they count (prompt tokens when the prefill ends, TTFT when the first token
    comes), and the engines in each pool."""

    def __init__(self, trace: Trace, engine: EngineModel, startup_s: float) -> None:
        self.trace, self.engine, self.startup_s = trace, engine, startup_s
        n = int(trace.duration_s // BIN_S) + int(3600 // BIN_S)  # + room for what ends later
        self.arrived, self.prompt_in, self.output_in = [0] * n, [0] * n, [0] * n
        self.prefill_tokens, self.prefill_time, self.prefill_done = [0] * n, [0.0] * n, [0] * n
        self.gap_time, self.tokens = [0.0] * n, [0.0] * n  # decode: stream-seconds, tokens
        self.ttft: list[list[float]] = [[] for _ in range(n)]
        self.ready = ([0] * n, [0] * n)  # engines taking new work, per pool
        self.active = ([0] * n, [0] * n)  # engines not draining: the replicas asked for
        self.alive = ([0] * n, [0] * n)  # engines that exist (starting, serving or draining)
        self.prefill: list[PrefillEngine] = []
        self.decode: list[DecodeEngine] = []
        self._heap: list[tuple[float, int, int, Any, int]] = []
        self._seq = itertools.count()
        self._arrival = trace.arrival.tolist()
        self._prompt, self._output = trace.prompt.tolist(), trace.output.tolist()

    # -- what the policies read

    def counts(self) -> tuple[int, int]:
        """Engines of each pool not draining: the replicas a Deployment would say."""
        return (
            sum(not e.draining for e in self.prefill),
            sum(not e.draining for e in self.decode),
        )

    def observation(self, now: float, interval_s: float) -> Observation:
        """The planner's view of the last `interval_s` seconds."""
        bins = range(max(0, int((now - interval_s) // BIN_S)), int(now // BIN_S))
        requests = sum(self.arrived[b] for b in bins)
        ttft = [x for b in bins for x in self.ttft[b]]
        done = sum(self.prefill_done[b] for b in bins)
        tokens = sum(self.tokens[b] for b in bins)
        return Observation(
            interval_s=interval_s,
            requests=requests,
            prompt_tokens_mean=sum(self.prompt_in[b] for b in bins) / max(1, requests),
            output_tokens_mean=sum(self.output_in[b] for b in bins) / max(1, requests),
            prefill_replicas=sum(self.ready[0][b] for b in bins) / len(bins),
            decode_replicas=sum(self.ready[1][b] for b in bins) / len(bins),
            prefill_tokens_per_s=sum(self.prefill_tokens[b] for b in bins) / interval_s,
            decode_tokens_per_s=tokens / interval_s,
            ttft_p90_s=float(np.percentile(ttft, 90)) if ttft else None,
            ttft_mean_s=sum(ttft) / len(ttft) if ttft else None,
            prefill_ttft_mean_s=sum(self.prefill_time[b] for b in bins) / done if done else None,
            itl_mean_s=sum(self.gap_time[b] for b in bins) / tokens if tokens else None,
        )

    def prefill_waiting(self, now: float) -> list[int]:
        """`vllm:num_requests_waiting` of each prefill engine that serves."""
        return [e.waiting(now) for e in self.prefill if e.ready_at <= now and not e.draining]

    def prefill_ttft_mean(self, now: float, window_s: float = 60.0) -> list[float]:
        """The prefill engines' TTFT mean over the last `window_s` (prometheus-adapter's
        `rate(_sum) / rate(_count)`) for each prefill engine that serves: the pool's mean, as
        the simulation does not keep it per engine."""
        bins = range(max(0, int((now - window_s) // BIN_S)), int(now // BIN_S))
        done = sum(self.prefill_done[b] for b in bins)
        mean = sum(self.prefill_time[b] for b in bins) / done if done else 0.0
        return [mean for e in self.prefill if e.ready_at <= now and not e.draining]

    def decode_kv_usage(self, now: float) -> list[float]:
        """`vllm:kv_cache_usage_perc` of each decode engine that serves."""
        usage = []
        for e in self.decode:
            if e.ready_at <= now and not e.draining:
                self._advance(e, now)
                used = e.kv_tokens() / self.engine.kv_capacity_tokens
                usage.append(min(1.0, max(0.0, used)))  # float sums may stray past 0 or 1
        return usage

    # -- the run

    def run(self, policy: Policy) -> None:
        start_p, start_d = policy.start()
        self.prefill = [PrefillEngine(0.0) for _ in range(start_p)]
        self.decode = [DecodeEngine(0.0) for _ in range(start_d)]
        arrival, heap = self._arrival, self._heap
        every = round(policy.period_s / BIN_S) if math.isfinite(policy.period_s) else 0
        i, n, tick = 0, len(arrival), 0
        while tick * BIN_S < self.trace.duration_s:
            next_tick = tick * BIN_S
            t_arrival = arrival[i] if i < n else math.inf
            t_event = heap[0][0] if heap else math.inf
            if next_tick <= t_arrival and next_tick <= t_event:
                self._tick(tick, next_tick)
                if every and tick and tick % every == 0:
                    self._scale(policy.tick(self, next_tick), next_tick)
                tick += 1
            elif t_arrival <= t_event:
                self._arrive(i, t_arrival)
                i += 1
            else:
                t, _, kind, what, version = heapq.heappop(heap)
                if kind == _JOIN:
                    self._join(what, t)
                elif version == what.version:
                    self._depart(what, t)

    def _scale(self, counts: tuple[int, int], now: float) -> None:
        """Starts engines (ready after the start-up delay) or drains them: the ones still
        starting first, which go at once, then the least loaded."""
        for pool, target in enumerate(counts):
            engines: list[Any] = (self.prefill, self.decode)[pool]
            active = [e for e in engines if not e.draining]
            if target > len(active):
                make = (PrefillEngine, DecodeEngine)[pool]
                engines += [make(now + self.startup_s) for _ in range(target - len(active))]
                continue
            active.sort(key=lambda e: (e.ready_at <= now, e.backlog()))
            for e in active[: len(active) - target]:
                e.draining = True
                if e.ready_at > now:
                    engines.remove(e)

    def _arrive(self, r: int, t: float) -> None:
        prompt = self._prompt[r]
        best = None
        for e in self.prefill:
            if not e.draining and e.ready_at <= t and (best is None or e.free_at < best.free_at):
                best = e
        if best is None:  # none ready yet: the one that will be
            best = min((e for e in self.prefill if not e.draining), key=lambda e: e.free_at)
        start = max(t, best.free_at)
        done = start + self.engine.prefill_s(prompt)
        best.free_at = done
        if start > t:
            best.starts.append(start)
        b = int(t // BIN_S)
        self.arrived[b] += 1
        self.prompt_in[b] += prompt
        self.output_in[b] += self._output[r]
        b = int(done // BIN_S)
        self.prefill_tokens[b] += prompt
        self.prefill_time[b] += done - t
        self.prefill_done[b] += 1
        joins = done + self.engine.handoff_s(prompt)
        heapq.heappush(self._heap, (joins, next(self._seq), _JOIN, r, 0))

    def _join(self, r: int, t: float) -> None:
        best = None
        for e in self.decode:
            if not e.draining and e.ready_at <= t and (best is None or e.load() < best.load()):
                best = e
        if best is None:  # none ready: the request joins when the first one is
            ready_at = min(e.ready_at for e in self.decode if not e.draining)
            heapq.heappush(self._heap, (ready_at, next(self._seq), _JOIN, r, 0))
            return
        self._advance(best, t)
        if self._admits(best, self._prompt[r]):
            self._admit(best, r, t)
            self._reschedule(best, t)
        else:
            best.waiting.append(r)

    def _depart(self, e: DecodeEngine, t: float) -> None:
        self._advance(e, t)
        while e.finish and e.finish[0][0] <= e.clock + 1e-6:
            _, joined, r = heapq.heappop(e.finish)
            e.prompt_sum -= self._prompt[r]
            e.join_sum -= joined
        while e.waiting and self._admits(e, self._prompt[e.waiting[0]]):
            self._admit(e, e.waiting.popleft(), t)
        self._reschedule(e, t)

    def _admits(self, e: DecodeEngine, prompt: int) -> bool:
        if len(e.finish) >= self.engine.max_num_seqs:
            return False
        return not e.finish or e.kv_tokens() + prompt <= self.engine.kv_capacity_tokens

    def _admit(self, e: DecodeEngine, r: int, t: float) -> None:
        heapq.heappush(e.finish, (e.clock + self._output[r], e.clock, r))
        e.prompt_sum += self._prompt[r]
        e.join_sum += e.clock
        first = t + self.engine.step_s(len(e.finish))
        self.ttft[int(first // BIN_S)].append(first - self._arrival[r])

    def _reschedule(self, e: DecodeEngine, t: float) -> None:
        e.version += 1
        if e.finish:
            ends = t + (e.finish[0][0] - e.clock) * self.engine.step_s(len(e.finish))
            heapq.heappush(self._heap, (ends, next(self._seq), _DEPART, e, e.version))

    def _advance(self, e: DecodeEngine, t: float) -> None:
        """Runs `e`'s steps up to `t`, counting its tokens and stream-seconds into the bins."""
        start, streams = e.last, len(e.finish)
        if t <= start:
            return
        e.last = t
        if not streams:
            return
        step = self.engine.step_s(streams)
        e.clock += (t - start) / step
        while start < t:
            b = int(start // BIN_S)
            end = min(t, (b + 1) * BIN_S)
            self.gap_time[b] += streams * (end - start)
            self.tokens[b] += streams * (end - start) / step
            start = end

    def _tick(self, b: int, now: float) -> None:
        self.prefill = [e for e in self.prefill if not (e.draining and e.free_at <= now)]
        self.decode = [e for e in self.decode if not (e.draining and not e.load())]
        pools: tuple[Sequence[Engine], Sequence[Engine]] = (self.prefill, self.decode)
        for pool, engines in enumerate(pools):
            self.ready[pool][b] = sum(e.ready_at <= now and not e.draining for e in engines)
            self.active[pool][b] = sum(not e.draining for e in engines)
            self.alive[pool][b] = len(engines)


# ---------------------------------------------------------------- the policies


@dataclass
class FixedPolicy:
    """Pools of fixed size, sized for the peak."""

    prefill: int
    decode: int
    name: str = "peak"
    period_s: float = math.inf

    def start(self) -> tuple[int, int]:
        return self.prefill, self.decode

    def tick(self, sim: Simulation, now: float) -> tuple[int, int]:
        return self.prefill, self.decode


class HpaPolicy:
    """A HorizontalPodAutoscaler per pool on today's engine metrics, as Kubernetes runs one:
    every 15 s desired = ceil(current * metric / target), the metric averaged over the pool's
    pods with pods still starting counted as 0 (as the HPA counts pods without metrics when
    scaling up); nothing within 10% of the target; up by at most max(100%, 4 pods) a sync;
    down only to the highest recommendation of the last 5 minutes. Decode scales on KV cache
    usage (target 0.8); prefill on waiting requests (target 4, `hpa`) or, as the chart now
    defaults to, on the prefill engines' TTFT mean over a minute (target 1 s, `hpa-ttft`)."""

    period_s = 15.0

    def __init__(self, spec: PlannerSpec, prefill_metric: Literal["waiting", "ttft"]) -> None:
        self.name = "hpa" if prefill_metric == "waiting" else "hpa-ttft"
        self._prefill_metric = prefill_metric
        self._bounds = ((spec.prefill_min, spec.prefill_max), (spec.decode_min, spec.decode_max))
        self._targets = (4.0 if prefill_metric == "waiting" else 1.0, 0.8)
        self._history: tuple[deque[tuple[float, int]], ...] = (deque(), deque())

    def start(self) -> tuple[int, int]:
        return self._bounds[0][0], self._bounds[1][0]

    def tick(self, sim: Simulation, now: float) -> tuple[int, int]:
        current = sim.counts()
        if self._prefill_metric == "waiting":
            prefill_values: Sequence[float] = sim.prefill_waiting(now)
        else:
            prefill_values = sim.prefill_ttft_mean(now)
        prefill = self._desired(0, prefill_values, current[0], now)
        decode = self._desired(1, sim.decode_kv_usage(now), current[1], now)
        return prefill, decode

    def _desired(self, pool: int, values: Sequence[float], current: int, now: float) -> int:
        ratio = sum(values) / (self._targets[pool] * current)
        want = current if abs(ratio - 1) <= 0.1 else math.ceil(ratio * current)
        low, high = self._bounds[pool]
        want = max(low, min(high, want, max(2 * current, current + 4)))
        history = self._history[pool]
        history.append((now, want))
        while history[0][0] <= now - 300.0:
            history.popleft()
        if want < current:
            want = min(current, max(w for _, w in history))
        return want


class PlannerPolicy:
    """The SLO planner, fed the simulation's metrics each interval."""

    name = "planner"

    def __init__(self, spec: PlannerSpec, config: PlannerConfig | None = None) -> None:
        self.spec = spec
        self.planner = Planner(spec, config or PlannerConfig())
        self.period_s = float(spec.interval_seconds)

    def start(self) -> tuple[int, int]:
        return self.spec.prefill_min, self.spec.decode_min

    def tick(self, sim: Simulation, now: float) -> tuple[int, int]:
        self.planner.observe(sim.observation(now, self.period_s))
        decision = self.planner.decide(now, *sim.counts())
        return decision.prefill, decision.decode


# ---------------------------------------------------------------- results


@dataclass(frozen=True)
class RunResult:
    """One policy's day: SLO attainment over its 60 s intervals and the engine-hours it used."""

    name: str
    slo_met: float  # share of intervals with both targets met
    ttft_met: float
    itl_met: float
    prefill_hours: float
    decode_hours: float
    most: tuple[int, int]  # the most engines each pool was asked for
    wall_s: float
    active: tuple[list[float], list[float]]  # engines asked for, mean per SLO interval

    @property
    def engine_hours(self) -> float:
        return self.prefill_hours + self.decode_hours


def simulate(
    trace: Trace,
    engine: EngineModel,
    policy: Policy,
    targets: tuple[float, float],
    startup_s: float,
) -> RunResult:
    """Runs `policy` over `trace` and scores it: each 60 s interval after the warm-up meets
    the targets when the p90 of the TTFTs that came in it and the mean of its ITL gaps are
    within them (an interval with none counts as met); engine-hours count every engine that
    exists, starting and draining ones included."""
    started = time.perf_counter()
    sim = Simulation(trace, engine, startup_s)
    sim.run(policy)
    per = round(SLO_INTERVAL_S / BIN_S)
    intervals = int(trace.duration_s // SLO_INTERVAL_S)
    ttft_ok, itl_ok = [], []
    for k in range(round(WARMUP_S / SLO_INTERVAL_S), intervals):
        bins = range(k * per, (k + 1) * per)
        ttft = [x for b in bins for x in sim.ttft[b]]
        tokens = sum(sim.tokens[b] for b in bins)
        ttft_ok.append(not ttft or float(np.percentile(ttft, 90)) <= targets[0])
        itl_ok.append(not tokens or sum(sim.gap_time[b] for b in bins) / tokens <= targets[1])
    both = [a and b for a, b in zip(ttft_ok, itl_ok, strict=True)]
    n = intervals * per

    def per_interval(series: list[int]) -> list[float]:
        return [sum(series[k * per : (k + 1) * per]) / per for k in range(intervals)]

    return RunResult(
        name=policy.name,
        slo_met=sum(both) / len(both),
        ttft_met=sum(ttft_ok) / len(both),
        itl_met=sum(itl_ok) / len(both),
        prefill_hours=sum(sim.alive[0][:n]) * BIN_S / 3600,
        decode_hours=sum(sim.alive[1][:n]) * BIN_S / 3600,
        most=(max(sim.active[0][:n]), max(sim.active[1][:n])),
        wall_s=time.perf_counter() - started,
        active=(per_interval(sim.active[0]), per_interval(sim.active[1])),
    )


@dataclass(frozen=True)
class Comparison:
    """The three policies on one trace."""

    trace: Trace
    targets: tuple[float, float]  # TTFT p90, ITL mean (s)
    spec: PlannerSpec
    runs: dict[str, RunResult]

    @property
    def aim_met(self) -> bool:
        """>= 99% of intervals within both targets on >= 30% fewer engine-hours than peak."""
        planner, peak = self.runs["planner"], self.runs["peak"]
        return planner.slo_met >= 0.99 and planner.engine_hours <= 0.7 * peak.engine_hours


def compare(
    engine: EngineModel,
    trace_config: TraceConfig,
    startup_s: float = 60.0,
    config: PlannerConfig | None = None,
) -> Comparison:
    """The planner first, then fixed pools of the most engines it asked for (sizing for the peak
    with the planner's own capacity and headroom), then the HPAs, all on one trace."""
    trace = make_trace(trace_config)
    targets = slo_targets(engine, trace)
    spec = PlannerSpec(
        ttft_seconds=targets[0],
        itl_seconds=targets[1],
        interval_seconds=30,
        cooldown_seconds=120,
        prefill_min=1,
        prefill_max=MAX_ENGINES,
        decode_min=1,
        decode_max=MAX_ENGINES,
    )
    planner = simulate(trace, engine, PlannerPolicy(spec, config), targets, startup_s)
    peak = simulate(trace, engine, FixedPolicy(*planner.most), targets, startup_s)
    hpas = [
        simulate(trace, engine, HpaPolicy(spec, metric), targets, startup_s)
        for metric in ("waiting", "ttft")
    ]
    return Comparison(trace, targets, spec, {r.name: r for r in (peak, *hpas, planner)})


def format_report(c: Comparison) -> str:
    t = c.trace
    per_minute = np.convolve(t.rate, np.ones(60) / 60, mode="valid")
    lines = [
        f"trace: {t.duration_s / 3600:g} h, {len(t.arrival):,} requests, rate peak "
        f"{per_minute.max():.1f}/s (1-min mean, bursts included), mean "
        f"{len(t.arrival) / t.duration_s:.2f}/s; prompts mean {t.prompt.mean():.0f} tokens, "
        f"outputs mean {t.output.mean():.0f}",
        f"targets (2x unloaded): TTFT p90 <= {c.targets[0]:.3f} s, ITL mean <= "
        f"{c.targets[1] * 1000:.1f} ms, per {SLO_INTERVAL_S:.0f} s interval",
        f"{'policy':<10}{'SLO met':>9}{'TTFT met':>10}{'ITL met':>9}{'engine-h':>10}"
        f"{'prefill-h':>11}{'decode-h':>10}{'most P/D':>10}{'wall s':>8}",
    ]
    for r in c.runs.values():
        lines.append(
            f"{r.name:<10}{r.slo_met:>9.2%}{r.ttft_met:>10.2%}{r.itl_met:>9.2%}"
            f"{r.engine_hours:>10.1f}{r.prefill_hours:>11.1f}{r.decode_hours:>10.1f}"
            f"{f'{r.most[0]}/{r.most[1]}':>10}{r.wall_s:>8.1f}"
        )
    planner = c.runs["planner"]
    lines.append(
        "engine-hours "
        + ", ".join(
            f"planner/{name} {planner.engine_hours / r.engine_hours:.2f}"
            for name, r in c.runs.items()
            if name != "planner"
        )
    )
    lines.append(
        "aim (planner: >= 99% of intervals met on <= 0.70x peak engine-hours): "
        + ("met" if c.aim_met else "NOT met")
    )
    return "\n".join(lines)


def to_json(c: Comparison, engine: EngineModel, trace_config: TraceConfig) -> dict[str, Any]:
    per = round(300 / SLO_INTERVAL_S)  # the timeline in 5-minute steps

    def coarse(series: Sequence[float]) -> list[float]:
        return [round(float(np.mean(series[i : i + per])), 2) for i in range(0, len(series), per)]

    rate = c.trace.rate[: len(c.trace.rate) // 300 * 300].reshape(-1, 300).mean(axis=1)
    return {
        "trace": {
            **{k: v for k, v in trace_config.__dict__.items()},
            "requests": len(c.trace.arrival),
        },
        "engine": engine.__dict__,
        "targets": {"ttft_p90_s": c.targets[0], "itl_mean_s": c.targets[1]},
        "planner_spec": c.spec.__dict__,
        "results": {
            name: {
                "slo_met": r.slo_met,
                "ttft_met": r.ttft_met,
                "itl_met": r.itl_met,
                "engine_hours": r.engine_hours,
                "prefill_hours": r.prefill_hours,
                "decode_hours": r.decode_hours,
                "most_prefill": r.most[0],
                "most_decode": r.most[1],
            }
            for name, r in c.runs.items()
        },
        "engine_hours_planner_over": {
            name: c.runs["planner"].engine_hours / r.engine_hours
            for name, r in c.runs.items()
            if name != "planner"
        },
        "aim_met": c.aim_met,
        "timeline_5min": {
            "rate_per_s": [round(float(x), 2) for x in rate],
            **{
                f"{name}_{pool}": coarse(r.active[i])
                for name, r in c.runs.items()
                for i, pool in enumerate(("prefill", "decode"))
            },
        },
    }


def plot(c: Comparison, path: Path) -> bool:
    """Load and replicas over the day; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    hours = np.arange(len(c.runs["planner"].active[0])) * SLO_INTERVAL_S / 3600
    rate = c.trace.rate[: len(hours) * 60].reshape(-1, 60).mean(axis=1)
    fig, axes = plt.subplots(3, 1, figsize=(8, 7.5), sharex=True)
    axes[0].plot(hours, rate, color="black", linewidth=0.8)
    axes[0].set_ylabel("requests/s")
    axes[0].set_title("Offered load (1-minute mean of the Poisson rate)")
    for ax, pool, i in ((axes[1], "prefill", 0), (axes[2], "decode", 1)):
        for name, style, width in (
            ("peak", ":", 1.5), ("hpa", "-", 0.5), ("hpa-ttft", "-", 0.5), ("planner", "-", 1.5)
        ):  # fmt: skip
            ax.plot(hours, c.runs[name].active[i], style, label=name, linewidth=width)
        ax.set_ylabel(f"{pool} engines")
        ax.legend(loc="upper left")
    axes[2].set_xlabel("hour of the day")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calibrate", action="store_true", help="measure the engines, then exit")
    p.add_argument("--calibration", type=Path, default=CALIBRATION_PATH)
    p.add_argument("--hours", type=float, default=24.0, help="the day's shape in this long")
    p.add_argument("--peak-rate", type=float, default=TraceConfig.peak_rate)
    p.add_argument("--startup", type=float, default=60.0, help="engine start-up delay, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=ROOT / "docs" / "results" / "planner_sim.json")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "planner_sim.png")
    args = p.parse_args(argv)
    if args.calibrate:
        cal = calibrate(args.calibration)
        print(json.dumps({k: v for k, v in cal.items() if k != "points"}, indent=2))
        return 0
    cal = json.loads(args.calibration.read_text())
    engine = EngineModel.from_calibration(cal)
    trace_config = TraceConfig(hours=args.hours, peak_rate=args.peak_rate, seed=args.seed)
    result = compare(engine, trace_config, args.startup)
    print(f"calibration: {cal['command']} on {cal['date']} ({cal['machine']})")
    print(format_report(result))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "command": " ".join(["python bench/planner_sim.py", *(argv or sys.argv[1:])]),
        "date": datetime.date.today().isoformat(),
        "calibration": {k: cal[k] for k in ("command", "date", "machine")},
        "startup_s": args.startup,
        **to_json(result, engine, trace_config),
    }
    args.json.write_text(json.dumps(summary, indent=1) + "\n")
    if plot(result, args.plot):
        print(f"plot: {args.plot}")
    else:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
