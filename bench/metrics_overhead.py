"""Metrics overhead: what recording vLLM's metrics costs the engine server and the router.

Engine: two `baton engine` servers on a tiny random model, one as deployed and one with
`--disable-log-stats` (no per-request or per-step recording; the gauges and the HTTP metrics
stay), get the same streams of short greedy completions over HTTP (bench/serve.py's client), in
alternating rounds. Per server: output tokens/s, the mean time per output token (the engine's
step time, with every stream running) and the CPU of the API server process per request, where
the recording happens; medians over the rounds, and their ratios on/off. On shared cores those
ratios carry the noise of the machine, so the per-request recording (`RequestTimer`) is also
timed apart, fed the snapshots of one request.

Router: it has no switch to turn its metrics off, so the metric calls one request makes (its
three `RouterMetrics` calls and the HTTP middleware) are timed directly in a loop, and set
against the router's CPU per request measured end to end (bench/router.py's fake engine and
load, 64 streams at a time): on/off is that CPU over the same less the calls.

    python bench/metrics_overhead.py [--rounds 3] [--requests 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

if not __package__:  # run as `python bench/metrics_overhead.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry
from starlette.types import Message, Receive, Scope, Send

from baton.engine.api.metrics import EngineMetrics, RequestTimer
from baton.engine.models.tiny import write_tiny_model
from baton.engine.outputs import CompletionOutput, RequestOutput
from baton.engine.protocol import EngineStats
from baton.engine.sampling_params import SamplingParams
from baton.http_metrics import HTTPMetrics
from baton.ports import free_port
from baton.router.engines import EngineSet
from baton.router.metrics import RouterMetrics
from bench.router import (
    PROMPT,
    ROOT,
    _request,
    _stop,
    cpu_seconds,
    load,
    start_engine,
    start_router,
)
from bench.serve import BenchConfig, run_benchmark

STREAMS = 64
ROUTE = "/v1/completions"
_READY_SECONDS = 180.0  # two engines load side by side on shared cores


def _start_engines(
    model: Path, modes: dict[str, list[str]], logs: Path
) -> dict[str, tuple[str, subprocess.Popen[bytes]]]:
    """`baton engine` servers by mode, each with the mode's extra flags, started side by side;
    their output goes to files under `logs`."""
    procs = {}
    for i, (name, flags) in enumerate(modes.items()):
        port = free_port()
        argv = [sys.executable, "-m", "baton.cli", "--log-level", "WARNING", "engine",
                "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                "--max-model-len", "512", "--num-gpu-blocks-override", "2048",
                "--disable-uvicorn-access-log", *flags]  # fmt: skip
        with open(logs / f"engine-{i}.log", "wb") as log:
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        procs[name] = (f"http://127.0.0.1:{port}", proc)
    deadline = time.monotonic() + _READY_SECONDS
    for i, (url, proc) in enumerate(procs.values()):
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                for _, p in procs.values():
                    p.kill()
                log_text = (logs / f"engine-{i}.log").read_text(errors="replace")
                raise RuntimeError(f"the engine at {url} did not start:\n{log_text[-2000:]}")
            time.sleep(0.2)
    return procs


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _engine_round(url: str, pid: int, config: BenchConfig) -> dict[str, float]:
    """One run of the workload against the server at `url` (API server process `pid`)."""
    cpu = cpu_seconds(pid)
    result = asyncio.run(run_benchmark(dataclasses.replace(config, base_url=url)))
    m = result.metrics
    if m["failed"]:
        raise RuntimeError(f"{m['failed']} requests failed: {m['first_error']}")
    return {
        "output_tok_s": m["output_throughput"],
        "tpot_ms": m["mean_tpot_ms"],
        "server_cpu_ms_per_request": (cpu_seconds(pid) - cpu) * 1000 / m["completed"],
    }


def measure_engine(rounds: int, requests: int, tokens: int) -> dict[str, dict[str, float]]:
    """Medians per mode over `rounds` alternating rounds, after a warm-up round each."""
    config = BenchConfig(
        num_prompts=requests,
        random_input_len=tokens,
        random_output_len=tokens,
        vocab_size=512,  # the tiny model's
        max_concurrency=STREAMS,
    )
    warm = dataclasses.replace(config, num_prompts=STREAMS, seed=1)
    modes = {"metrics on": [], "--disable-log-stats": ["--disable-log-stats"]}
    with tempfile.TemporaryDirectory(prefix="metrics-overhead-") as tmp:
        model = write_tiny_model(Path(tmp) / "model", "llama", "tiny")
        engines = _start_engines(model, modes, Path(tmp))
        try:
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
            for url, proc in engines.values():
                _engine_round(url, proc.pid, warm)
            for _ in range(rounds):
                for name, (url, proc) in engines.items():
                    runs[name].append(_engine_round(url, proc.pid, config))
        finally:
            for _, proc in engines.values():
                proc.terminate()
                proc.wait(30)
    return {
        name: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for name, results in runs.items()
    }


def request_timer_us(tokens: int, n: int = 2000) -> float:
    """CPU µs the per-request metrics cost one streamed request of `tokens` tokens: a
    `RequestTimer` fed the snapshots the server sees, one per token."""
    metrics = EngineMetrics(
        EngineStats, "m", "0", max_model_len=512, cache_config={"block_size": "16"}
    )
    params = SamplingParams(max_tokens=tokens)
    ids = list(range(tokens))
    outputs = [
        RequestOutput(
            "r",
            None,
            ids,
            [CompletionOutput(0, "", ids[:k], finish_reason="length" if k == tokens else None)],
            finished=k == tokens,
            queue_time=0.001,
            prefill_time=0.01,
        )
        for k in range(1, tokens + 1)
    ]
    start = time.process_time()
    for _ in range(n):
        timer = RequestTimer(metrics, tokens, params)
        for out in outputs:
            timer.on_output(out)
        timer.on_closed()
    return (time.process_time() - start) / n * 1e6


def measure_router(requests: int) -> float:
    """The router's CPU ms per streamed request at 64 streams, against the fake engine."""
    engine, (engine_port,) = start_engine(1, 0.0, None)
    try:
        router, port = start_router([engine_port], None)
        try:
            stream = [_request(PROMPT, 16, True)]
            load(port, stream, 200, STREAMS, 1, None)  # warm-up
            cpu = cpu_seconds(router.pid)
            load(port, stream, requests, STREAMS, 1, None)
            return (cpu_seconds(router.pid) - cpu) * 1000 / requests
        finally:
            _stop(router)
    finally:
        _stop(engine)


def router_metric_calls_us(n: int = 200_000) -> float:
    """CPU µs of the `RouterMetrics` calls one streamed request makes."""
    metrics = RouterMetrics(EngineSet())
    start = time.process_time()
    for _ in range(n):
        metrics.first_byte(ROUTE, 0.002)
        metrics.duration(ROUTE, 0.01)
        metrics.request(ROUTE, 200)
    return (time.process_time() - start) / n * 1e6


def middleware_us(n: int = 100_000) -> float:
    """CPU µs the HTTP metrics middleware adds to one request: the same trivial ASGI app
    called bare and through it."""

    async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        pass

    # As the router leaves it once it matched the route.
    scope = {"type": "http", "method": "POST", "path": ROUTE, "route": SimpleNamespace(path=ROUTE)}

    async def cpu_per_call(app: Any) -> float:
        start = time.process_time()
        for _ in range(n):
            await app(scope, receive, send)
        return (time.process_time() - start) / n * 1e6

    async def both() -> float:
        wrapped = HTTPMetrics(endpoint, CollectorRegistry())
        await cpu_per_call(wrapped)  # warm-up: the label children
        return await cpu_per_call(wrapped) - await cpu_per_call(endpoint)

    return asyncio.run(both())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per engine")
    parser.add_argument("--requests", type=int, default=128, help="completions per round")
    parser.add_argument("--tokens", type=int, default=32, help="prompt and output tokens each")
    parser.add_argument("--router-requests", type=int, default=1500)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()

    engine = measure_engine(args.rounds, args.requests, args.tokens)
    on, off = engine["metrics on"], engine["--disable-log-stats"]
    print(
        f"engine server, {STREAMS} streams, {args.requests} completions of {args.tokens} tokens "
        f"per round, median of {args.rounds} rounds:"
    )
    print(f"{'':22} {'tok/s':>8} {'TPOT ms':>8} {'API CPU ms/req':>15}")
    for name, r in engine.items():
        print(
            f"{name:22} {r['output_tok_s']:8.0f} {r['tpot_ms']:8.2f} "
            f"{r['server_cpu_ms_per_request']:15.3f}"
        )
    ratios = {key: on[key] / off[key] for key in on}
    print(
        f"{'ratio on/off':22} {ratios['output_tok_s']:8.3f} {ratios['tpot_ms']:8.3f} "
        f"{ratios['server_cpu_ms_per_request']:15.3f}"
    )
    timer_us = request_timer_us(args.tokens)
    print(
        f"timed apart: the per-request metrics cost {timer_us:.0f} us of CPU per request of "
        f"{args.tokens} tokens = {timer_us / 1000 / on['server_cpu_ms_per_request']:.1%} of the "
        "API server's CPU per request above"
    )

    router_cpu_ms = measure_router(args.router_requests)
    calls_us, middleware = router_metric_calls_us(), middleware_us()
    metrics_ms = (calls_us + middleware) / 1000
    router = {
        "cpu_ms_per_request": router_cpu_ms,
        "router_metric_calls_us": calls_us,
        "http_middleware_us": middleware,
        "cpu_ratio_on_off": router_cpu_ms / (router_cpu_ms - metrics_ms),
    }
    print(
        f"router (no off switch: its metric calls timed apart): {router_cpu_ms:.3f} ms of CPU "
        f"per streamed request at {STREAMS} streams; its metric calls {calls_us:.1f} us + HTTP "
        f"middleware {middleware:.1f} us = {metrics_ms / router_cpu_ms:.1%} of it; "
        f"CPU per request on/off x{router['cpu_ratio_on_off']:.3f}"
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "engine": engine,
                    "engine_ratios": ratios,
                    "request_timer_us": timer_us,
                    "router": router,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
