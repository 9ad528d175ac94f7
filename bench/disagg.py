"""Disaggregated against aggregated serving on a mixed workload, both behind `baton router`.

Two clusters of the built-in `small` model run side by side on this machine, each started with
`baton serve` and each engine on one torch thread (`OMP_NUM_THREADS=1`: with tensor parallel size
1 the engine core runs the model in its own process and never calls `torch.set_num_threads`, so
torch takes its intra-op thread count, and the C decode-attention kernel its OpenMP count, from
that variable):

- `disagg`: 1 prefill + 1 decode engine (`baton serve --prefill 1 --decode 1`); every request
  takes the prefill→decode hand-off.
- `agg`: 2 aggregated engines (`baton serve --engines 2`, role `both`).

The workload is open-loop: a Poisson stream of short chat-sized requests plus one long prompt
(2,000 tokens by default) at a fixed interval. Prompts are random token ids sent to
`/v1/completions`, so their lengths are exact; `ignore_eos`, greedy. Load generation and the
metric definitions (TTFT, ITL as every gap between two content chunks over all requests, output
throughput over first send to last response) are `bench/serve.py`'s, imported from it.
Beside p50 and p99, the report gives ITL p99.9, the longest gap and the gaps of 250 ms or more:
a long prefill stalls each stream of its engine once, which may be under 1% of all gaps.

Rounds alternate between the clusters (A B B A ...), each round a fresh set of prompts sent
identically to both, so drift in the machine's background load falls on both configurations.
Aim (issue 5, tightened by issue 23): disaggregated p99 ITL at most half of aggregated, at no
less than 0.95x the output throughput, in at least four of five runs.

    python bench/disagg.py [--duration 60] [--rounds 2] [--chat-rate 4] [--long-interval 4]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import httpx

if not __package__:  # run as `python bench/disagg.py`: make the `bench` folder importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.ports import free_port
from bench.serve import (
    SampledRequest,
    arrival_times,
    fetch_first_model,
    sample_random_requests,
    send_request,
)
from bench.serve_metrics import RequestRecord, compute_metrics

Kind = Literal["chat", "long"]
# p99.9 too: a long prefill stalls every stream of its engine once, which can be under 1% of gaps.
PERCENTILES = (50.0, 99.0, 99.9)
STALL_MS = 250.0  # an ITL gap this long counts as a stall
ROUND_KEYS = ("duration", "completed", "failed", "median_itl_ms", "p99_itl_ms", "output_throughput")
# Engine flags both clusters get. The KV budget is set (not the 4 GiB CPU default) so that four
# engines fit in memory next to other jobs; a 2,000-token prompt needs 8 MB of it.
KV_CACHE_BYTES = 1 << 30
WARMUP_S = 8.0  # chats for this long and one long prompt halfway, before the measured rounds


@dataclass(frozen=True)
class WorkloadConfig:
    """The mixed workload of one round; lengths in tokens, times in seconds."""

    duration_s: float = 60.0  # arrivals fall in [0, duration); the round ends when all finish
    chat_rate: float = 4.0  # chats per second, Poisson arrivals
    chat_input_len: int = 128
    chat_output_len: int = 128
    range_ratio: float = 0.5  # chat lengths uniform in [len * (1 - r), len * (1 + r)]
    long_interval_s: float = 4.0  # one long prompt every this many seconds, the first at half
    long_input_len: int = 2000
    long_output_len: int = 64
    vocab_size: int = 2048

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.chat_rate <= 0 or self.long_interval_s <= 0:
            raise ValueError("duration, chat rate and long interval must be > 0")
        if min(self.chat_input_len, self.chat_output_len) < 1:
            raise ValueError("chat lengths must be >= 1")
        if min(self.long_input_len, self.long_output_len) < 1:
            raise ValueError("long prompt lengths must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")

    @property
    def max_model_len(self) -> int:
        """The longest request, rounded up to a multiple of 256."""
        chat = math.ceil((self.chat_input_len + self.chat_output_len) * (1 + self.range_ratio))
        longest = max(chat, self.long_input_len + self.long_output_len)
        return 256 * math.ceil(longest / 256)


@dataclass(frozen=True)
class TimedRequest:
    """One request of a round: when it is sent (seconds from the round's start) and its class."""

    offset_s: float
    kind: Kind
    request: SampledRequest


def build_round(w: WorkloadConfig, seed: int) -> list[TimedRequest]:
    """The chats and long prompts of one round, in send order."""
    num_chats = max(1, round(w.chat_rate * w.duration_s))
    chat_times = [
        t for t in arrival_times(num_chats, w.chat_rate, "poisson", seed) if t < w.duration_s
    ]
    chats = sample_random_requests(
        len(chat_times), w.chat_input_len, w.chat_output_len, w.range_ratio, w.vocab_size, seed
    )
    num_longs = math.ceil(w.duration_s / w.long_interval_s)
    long_times = [
        t for i in range(num_longs) if (t := w.long_interval_s * (i + 0.5)) < w.duration_s
    ]
    longs = sample_random_requests(
        len(long_times), w.long_input_len, w.long_output_len, 0.0, w.vocab_size, seed + 10_000
    )
    timed = [TimedRequest(t, "chat", r) for t, r in zip(chat_times, chats, strict=True)]
    timed += [TimedRequest(t, "long", r) for t, r in zip(long_times, longs, strict=True)]
    return sorted(timed, key=lambda r: r.offset_s)


# ---------------------------------------------------------------- clusters


@dataclass(frozen=True)
class Setup:
    """One configuration under test: its name and the `baton serve` flags that make it."""

    name: str
    serve_args: tuple[str, ...]


class Cluster:
    """`baton serve` of one setup in its own process group, its output kept in a log file."""

    def __init__(self, setup: Setup, engine_args: Sequence[str], log_dir: Path) -> None:
        self.setup = setup
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{setup.name}.log"
        cmd = [
            sys.executable, "-m", "baton.cli", "--log-level", "WARNING", "serve",
            "--port", str(self.port), *setup.serve_args, *engine_args,
        ]  # fmt: skip
        # One torch thread per engine; the router and the API servers do not use torch threads.
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Returns once the router answers /health 200 (every engine checked once)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.setup.name}: baton serve exited\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(
            f"{self.setup.name}: not ready after {timeout_s:.0f} s\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def router_counters(self, prefixes: Sequence[str]) -> Counter[str]:
        """The router's counters whose name starts with one of `prefixes`, by full series."""
        counts: Counter[str] = Counter()
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith(tuple(prefixes)):
                series, _, value = line.rpartition(" ")
                counts[series] = float(value)  # type: ignore[assignment]
        return counts

    def stop(self) -> None:
        """SIGTERM (baton serve drains and stops everything), SIGKILL to its group if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


# ---------------------------------------------------------------- load


async def run_round(
    base_url: str, model: str, schedule: Sequence[TimedRequest], timeout_s: float
) -> tuple[list[tuple[Kind, RequestRecord]], float]:
    """Sends the round at its send times with `bench/serve.py`'s client; (records, duration)."""
    url = f"{base_url}/v1/completions"
    limits = httpx.Limits(max_connections=len(schedule), max_keepalive_connections=len(schedule))
    timeout = httpx.Timeout(timeout_s, connect=30.0, pool=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        tasks = []
        start = time.perf_counter()
        for item in schedule:
            delay = start + item.offset_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send_request(client, url, model, item.request)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return [(item.kind, r) for item, r in zip(schedule, records, strict=True)], duration


async def model_name(base_url: str) -> str:
    async with httpx.AsyncClient(trust_env=False) as client:
        return await fetch_first_model(client, base_url)


def summarize(records: Sequence[tuple[Kind, RequestRecord]], duration: float) -> dict[str, Any]:
    """`bench/serve.py`'s metrics over all requests, and over each class apart."""
    out = {}
    for scope in ("all", "chat", "long"):
        of_scope = [r for k, r in records if scope in ("all", k)]
        metrics = compute_metrics(of_scope, duration, None, PERCENTILES)
        gaps_ms = [gap * 1000.0 for r in of_scope if r.success for gap in r.itl]
        metrics["max_itl_ms"] = max(gaps_ms, default=0.0)
        metrics["itl_stalls"] = sum(gap >= STALL_MS for gap in gaps_ms)
        metrics["itl_gaps"] = len(gaps_ms)
        out[scope] = metrics
    return out


# ---------------------------------------------------------------- report


def _fmt_row(label: str, values: Sequence[float], ratio: float | None) -> str:
    cells = "".join(f"{v:>12.1f}" for v in values)
    return f"{label:<28}{cells}{'' if ratio is None else f'{ratio:>12.2f}'}"


def format_report(results: dict[str, dict[str, Any]]) -> str:
    d, a = results["disagg"]["metrics"], results["agg"]["metrics"]
    lines = [f"{'':<28}{'disagg':>12}{'agg':>12}{'disagg/agg':>12}"]
    for scope in ("all", "chat", "long"):
        if not d[scope]["completed"] and not a[scope]["completed"]:
            continue
        lines.append(f"-- {scope} requests ({d[scope]['completed']} / {a[scope]['completed']})")
        for key, label in (
            ("median_itl_ms", "ITL p50 (ms)"),
            ("p99_itl_ms", "ITL p99 (ms)"),
            ("p99.9_itl_ms", "ITL p99.9 (ms)"),
            ("max_itl_ms", "ITL max (ms)"),
            ("itl_stalls", f"ITL gaps >= {STALL_MS:.0f} ms"),
            ("median_ttft_ms", "TTFT p50 (ms)"),
            ("p99_ttft_ms", "TTFT p99 (ms)"),
            ("output_throughput", "output tok/s"),
        ):
            values = (d[scope][key], a[scope][key])
            lines.append(_fmt_row(label, values, values[0] / values[1] if values[1] else None))
    itl = d["all"]["p99_itl_ms"] / a["all"]["p99_itl_ms"]
    tput = d["all"]["output_throughput"] / a["all"]["output_throughput"]
    met = "met" if itl <= 0.5 and tput >= 0.95 else "NOT met"
    lines.append(f"aim (p99 ITL ratio <= 0.5 at throughput ratio >= 0.95): {met}")
    for name in ("disagg", "agg"):
        failed = results[name]["metrics"]["all"]["failed"]
        if failed:
            lines.append(
                f"{name}: {failed} failed, first: {results[name]['metrics']['all']['first_error']}"
            )
        if results[name]["router"]:
            lines.append(f"{name} router counters: {results[name]['router']}")
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    w = WorkloadConfig()
    p.add_argument(
        "--duration", type=float, default=w.duration_s, help="seconds of arrivals per round"
    )
    p.add_argument("--rounds", type=int, default=2, help="rounds per configuration, alternated")
    p.add_argument("--chat-rate", type=float, default=w.chat_rate, help="chats per second")
    p.add_argument("--chat-input-len", type=int, default=w.chat_input_len)
    p.add_argument("--chat-output-len", type=int, default=w.chat_output_len)
    p.add_argument("--range-ratio", type=float, default=w.range_ratio)
    p.add_argument("--long-interval", type=float, default=w.long_interval_s, help="seconds")
    p.add_argument("--long-input-len", type=int, default=w.long_input_len)
    p.add_argument("--long-output-len", type=int, default=w.long_output_len)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds")
    p.add_argument(
        "--router-arg", action="append", default=[], help="extra flag for the disagg router, "
        "e.g. --router-arg=--disagg-min-tokens=512"
    )  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="write every number to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from baton.engine.models.tiny import default_model_path  # writes the model on first use

    model_path = default_model_path()
    model_config = json.loads((model_path / "config.json").read_text())
    workload = WorkloadConfig(
        duration_s=args.duration,
        chat_rate=args.chat_rate,
        chat_input_len=args.chat_input_len,
        chat_output_len=args.chat_output_len,
        range_ratio=args.range_ratio,
        long_interval_s=args.long_interval,
        long_input_len=args.long_input_len,
        long_output_len=args.long_output_len,
        vocab_size=int(model_config["vocab_size"]),
    )
    max_positions = int(model_config["max_position_embeddings"])
    if workload.max_model_len > max_positions:
        raise SystemExit(
            f"requests need {workload.max_model_len} positions; the model has {max_positions}"
        )
    engine_args = [
        "--model", str(model_path), "--max-model-len", str(workload.max_model_len),
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
    ]  # fmt: skip
    setups = {
        "disagg": Setup("disagg", ("--prefill", "1", "--decode", "1", *args.router_arg)),
        "agg": Setup("agg", ("--engines", "2")),
    }
    load_before = os.getloadavg()
    log_dir = Path(tempfile.mkdtemp(prefix="baton-disagg-"))
    clusters: dict[str, Cluster] = {}
    try:
        for name, setup in setups.items():  # one at a time: model loads compete for the cores
            clusters[name] = Cluster(setup, engine_args, log_dir)
            clusters[name].wait_ready()
        model = asyncio.run(model_name(clusters["disagg"].url))
        counters = ("baton:router_disagg_decisions_total", "baton:router_upstream_errors_total")
        records: dict[str, list[tuple[Kind, RequestRecord]]] = {n: [] for n in setups}
        durations: dict[str, float] = dict.fromkeys(setups, 0.0)
        rounds: list[dict[str, Any]] = []
        router_before = {}
        # Warm-up (not measured): first connections, first-use allocations, one hand-off of a
        # long prompt; its prompts differ from every measured one.
        warm = replace(workload, duration_s=WARMUP_S, long_interval_s=WARMUP_S)
        for name, cluster in clusters.items():
            asyncio.run(
                run_round(cluster.url, model, build_round(warm, args.seed + 999), args.timeout)
            )
            router_before[name] = cluster.router_counters(counters)
        order = list(setups)
        for i in range(args.rounds):
            schedule = build_round(workload, args.seed + i)
            for name in order if i % 2 == 0 else order[::-1]:
                got, duration = asyncio.run(
                    run_round(clusters[name].url, model, schedule, args.timeout)
                )
                records[name] += got
                durations[name] += duration
                done = compute_metrics([r for _, r in got], duration, None, PERCENTILES)
                rounds.append({"round": i + 1, "setup": name, "load_average": os.getloadavg()[0]})
                rounds[-1].update({k: done[k] for k in ROUND_KEYS})
                print(
                    f"round {i + 1} {name}: {done['completed']} done, {done['failed']} failed, "
                    f"{duration:.1f} s, ITL p99 {done['p99_itl_ms']:.1f} ms, "
                    f"{done['output_throughput']:.0f} tok/s, load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
        results: dict[str, dict[str, Any]] = {}
        for name, cluster in clusters.items():
            after = cluster.router_counters(counters)
            router = {k: v - router_before[name].get(k, 0.0) for k, v in after.items()}
            results[name] = {
                "serve_args": list(setups[name].serve_args),
                "duration": durations[name],
                "metrics": summarize(records[name], durations[name]),
                "router": {k: v for k, v in router.items() if v},
            }
    finally:
        for cluster in clusters.values():
            cluster.stop()
    load_after = os.getloadavg()
    offered = (
        sum(t.request.max_tokens for t in build_round(workload, args.seed)) / workload.duration_s
    )
    print(
        f"workload: chats {workload.chat_rate}/s of {workload.chat_input_len} -> "
        f"{workload.chat_output_len} tokens (+-{workload.range_ratio:.0%}), one "
        f"{workload.long_input_len} -> {workload.long_output_len} prompt every "
        f"{workload.long_interval_s} s; {args.rounds} x {workload.duration_s} s rounds; "
        f"offered ~{offered:.0f} output tok/s; max_model_len {workload.max_model_len}"
    )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)")
    print(format_report(results))
    if args.json is not None:
        summary = {
            "workload": asdict(workload),
            "rounds": args.rounds,
            "engine_args": engine_args,
            "load_average_before": load_before,
            "load_average_after": load_after,
            "offered_output_tok_s": offered,
            "results": results,
            "rounds_detail": rounds,
            "ratios": {
                "p99_itl": results["disagg"]["metrics"]["all"]["p99_itl_ms"]
                / results["agg"]["metrics"]["all"]["p99_itl_ms"],
                "output_throughput": results["disagg"]["metrics"]["all"]["output_throughput"]
                / results["agg"]["metrics"]["all"]["output_throughput"],
            },
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
