"""Tests of bench/serve.py: metric definitions, arrivals, workload, and a run against a fake server.

The fake server is a fixture for the load generator only: a minimal asyncio HTTP/1.1 server that
streams `max_tokens` completion chunks with known delays.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import baton
from bench.serve import (
    BenchConfig,
    BenchmarkResult,
    RequestRecord,
    arrival_times,
    build_parser,
    compute_metrics,
    config_from_args,
    format_table,
    main,
    offline_engine,
    parse_goodput,
    parse_percentiles,
    run_benchmark,
    sample_random_requests,
    server_cpu,
)

# ---------------------------------------------------------------- compute_metrics


def _records() -> list[RequestRecord]:
    return [
        RequestRecord(10, True, 3, ttft=0.1, latency=0.16, itl=[0.02, 0.04]),  # TPOT 30 ms
        RequestRecord(20, True, 5, ttft=0.3, latency=0.5, itl=[0.05] * 4),  # TPOT 50 ms
        RequestRecord(5, True, 1, ttft=0.2, latency=0.2),  # one token: no TPOT
        RequestRecord(7, False, error="HTTP 500: boom"),
        RequestRecord(9, False, error="ReadTimeout"),
    ]


def test_metrics_counts_and_throughputs() -> None:
    """Throughputs divide successful requests' tokens by the duration; failures are only counted."""
    m = compute_metrics(_records(), duration=2.0, slos_ms={})
    assert m["completed"] == 3
    assert m["failed"] == 2
    assert m["first_error"] == "HTTP 500: boom"
    assert m["total_input_tokens"] == 35
    assert m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(22.0)
    assert m["request_goodput"] is None


def test_metrics_latency_statistics_exact() -> None:
    """TTFT/TPOT/ITL/E2EL mean, median and linearly interpolated percentiles match hand values."""
    m = compute_metrics(_records(), duration=2.0, slos_ms={}, percentiles=(50.0, 99.0))
    expected = {
        # TTFT over [100, 200, 300] ms; p99 = 200 + 0.98 * 100.
        "ttft": (200.0, 200.0, 298.0),
        # TPOT over [30, 50] ms only: the one-token request is excluded.
        "tpot": (40.0, 40.0, 49.8),
        # ITL over every gap [20, 40, 50, 50, 50, 50] ms.
        "itl": (260.0 / 6, 50.0, 50.0),
        # E2EL over [160, 500, 200] ms; p99 = 200 + 0.98 * 300.
        "e2el": (860.0 / 3, 200.0, 494.0),
    }
    for name, (mean, median, p99) in expected.items():
        assert m[f"mean_{name}_ms"] == pytest.approx(mean), name
        assert m[f"median_{name}_ms"] == pytest.approx(median), name
        assert m[f"p50_{name}_ms"] == pytest.approx(median), name
        assert m[f"p99_{name}_ms"] == pytest.approx(p99), name
    assert m["std_tpot_ms"] == pytest.approx(10.0)


def test_metrics_goodput_needs_every_slo() -> None:
    """Goodput counts a request only when it meets all given SLOs; one-token TPOT passes."""
    records = _records()
    # ttft <= 250 ms fails request 2; tpot <= 40 ms passes request 1 and the one-token request 3.
    m = compute_metrics(records, 2.0, {"ttft": 250, "tpot": 40})
    assert m["request_goodput"] == pytest.approx(1.0)
    # Adding e2el <= 180 ms leaves only request 1.
    m = compute_metrics(records, 2.0, {"ttft": 250, "tpot": 40, "e2el": 180})
    assert m["request_goodput"] == pytest.approx(0.5)
    # tpot <= 35 ms fails request 2 (50 ms) but not request 1 (30 ms) or the one-token request.
    m = compute_metrics(records, 2.0, {"tpot": 35})
    assert m["request_goodput"] == pytest.approx(1.0)


def test_metrics_all_failed_is_zero_not_error() -> None:
    """With no successful request every latency statistic is 0 and throughputs are 0."""
    m = compute_metrics([RequestRecord(4, False, error="x")], 1.0, {"ttft": 10})
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0
    assert m["output_throughput"] == 0.0 and m["request_goodput"] == 0.0


def test_metrics_rejects_bad_input() -> None:
    """Unknown SLO names and a non-positive duration raise ValueError."""
    with pytest.raises(ValueError, match="unknown SLO"):
        compute_metrics(_records(), 1.0, {"itl": 5})
    with pytest.raises(ValueError, match="duration"):
        compute_metrics(_records(), 0.0, {})


# ---------------------------------------------------------------- arrivals and workload


def test_poisson_arrivals_seeded_with_right_mean() -> None:
    """Poisson send times are reproducible per seed and their gaps average 1 / rate."""
    times = arrival_times(20_000, 50.0, "poisson", seed=7)
    assert times == arrival_times(20_000, 50.0, "poisson", seed=7)
    assert times != arrival_times(20_000, 50.0, "poisson", seed=8)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean.
    assert gaps.std() == pytest.approx(1 / 50.0, rel=0.05)


def test_fixed_and_infinite_rate_arrivals() -> None:
    """A fixed rate spaces sends exactly 1 / rate apart; an infinite rate sends all at time 0."""
    assert arrival_times(4, 10.0, "fixed", seed=0) == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert arrival_times(3, math.inf, "poisson", seed=0) == [0.0, 0.0, 0.0]


def test_random_workload_lengths_and_ids() -> None:
    """Lengths are uniform in [len*(1-r), len*(1+r)], ids avoid 0-2, and the seed fixes it all."""
    reqs = sample_random_requests(500, 100, 20, 0.5, vocab_size=64, seed=3)
    assert reqs == sample_random_requests(500, 100, 20, 0.5, vocab_size=64, seed=3)
    in_lens = [len(r.prompt_token_ids) for r in reqs]
    out_lens = [r.max_tokens for r in reqs]
    assert min(in_lens) >= 50 and max(in_lens) <= 150 and len(set(in_lens)) > 50
    assert min(out_lens) >= 10 and max(out_lens) <= 30
    ids = [i for r in reqs for i in r.prompt_token_ids]
    assert min(ids) == 3 and max(ids) == 63
    fixed = sample_random_requests(5, 8, 4, 0.0, vocab_size=64, seed=0)
    assert all(len(r.prompt_token_ids) == 8 and r.max_tokens == 4 for r in fixed)


def test_cli_parsing() -> None:
    """CLI flags become a validated config; p99 is always reported; bad SLOs are rejected."""
    argv = "--request-rate 5 --max-concurrency 64 --percentiles 50,90 --arrival fixed"
    args = build_parser().parse_args(
        [*argv.split(), "--goodput", "ttft:500", "tpot:50", "e2el:2000"]
    )
    config = config_from_args(args)
    assert config.request_rate == 5.0 and config.max_concurrency == 64
    assert config.arrival == "fixed"
    assert config.percentiles == (50.0, 90.0, 99.0)
    assert dict(config.slos_ms) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert parse_percentiles([]) == (99.0,)
    assert math.isinf(config_from_args(build_parser().parse_args([])).request_rate)
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    with pytest.raises(ValueError, match="max_concurrency"):
        BenchConfig(max_concurrency=0)


# ---------------------------------------------------------------- end to end, fake server

TTFT_S = 0.12
ITL_S = 0.03


@dataclass
class FakeServerState:
    """What the fake server saw: requests, and the most streams it had open at once."""

    bodies: list[dict[str, Any]]
    open_streams: int = 0
    peak_streams: int = 0


async def _fake_openai_server(
    state: FakeServerState,
) -> tuple[asyncio.Server, int]:
    """Streams `max_tokens` chunks: the first after TTFT_S, the rest ITL_S apart, then usage.

    Model `no-usage` sends no usage chunk; model `broken` answers HTTP 500.
    """

    async def write_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    async def stream(writer: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        n = body["max_tokens"]
        state.open_streams += 1
        state.peak_streams = max(state.peak_streams, state.open_streams)
        try:
            # Model `no-usage` sends the finish reason in a chunk of its own, with no text.
            apart = body["model"] == "no-usage"
            chunks: list[dict[str, Any]] = []
            for i in range(n):
                finish = "length" if i == n - 1 and not apart else None
                chunks.append(
                    {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": finish}]}
                )
            if apart:
                chunks.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            else:
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
                chunks.append({"choices": [], "usage": usage})
            for i, chunk in enumerate(chunks):
                await asyncio.sleep(TTFT_S if i == 0 else ITL_S if i < n else 0.0)
                await write_chunk(writer, f"data: {json.dumps(chunk)}\n\n".encode())
            await write_chunk(writer, b"data: [DONE]\n\n")
            await write_chunk(writer, b"")
        finally:
            state.open_streams -= 1

    def respond(writer: asyncio.StreamWriter, status: str, payload: object) -> None:
        data = json.dumps(payload).encode()
        writer.write(
            f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: one request after another on this connection
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *header_lines = head.decode().split("\r\n")
                method, path, _ = request_line.split(" ", 2)
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (h.partition(":") for h in header_lines if h)
                }
                raw = await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "GET" and path == "/v1/models":
                    model = {"id": "fake-model", "max_model_len": 512}
                    respond(writer, "200 OK", {"object": "list", "data": [model]})
                elif method == "GET" and path == "/metrics":
                    text = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="77"} 1.0\n'
                    writer.write(
                        f"HTTP/1.1 200 OK\r\nContent-Length: {len(text)}\r\n\r\n{text}".encode()
                    )
                elif method == "POST" and path == "/v1/completions":
                    body = json.loads(raw)
                    state.bodies.append(body)
                    if body["model"] == "broken":
                        respond(writer, "500 Internal Server Error", {"error": "broken on purpose"})
                    else:
                        await stream(writer, body)
                else:
                    respond(writer, "404 Not Found", {"error": "no such route"})
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, port


def _with_fake_server(
    make_config: Callable[[str], BenchConfig],
) -> tuple[BenchmarkResult, FakeServerState]:
    async def go() -> tuple[BenchmarkResult, FakeServerState]:
        state = FakeServerState(bodies=[])
        server, port = await _fake_openai_server(state)
        try:
            result = await run_benchmark(make_config(f"http://127.0.0.1:{port}"))
        finally:
            server.close()
            await server.wait_closed()
        return result, state

    return asyncio.run(go())


def test_end_to_end_timings_tokens_and_concurrency() -> None:
    """Against a server with known delays, TTFT/ITL/TPOT match them, tokens come from usage, the
    request body is what vLLM's benchmark sends, and the concurrency cap holds."""
    result, state = _with_fake_server(
        lambda url: BenchConfig(
            base_url=url,
            num_prompts=8,
            random_input_len=16,
            random_output_len=6,
            random_range_ratio=0.5,
            max_concurrency=4,
            percentiles=(50.0, 99.0),
            num_warmups=1,
        )
    )
    m = result.metrics
    warmup, *measured = state.bodies
    assert warmup["prompt"] not in [b["prompt"] for b in measured]
    assert result.model == "fake-model"  # taken from /v1/models
    assert m["completed"] == 8 and m["failed"] == 0
    requested = [b["max_tokens"] for b in measured]
    assert [r.output_tokens for r in result.records] == requested
    assert m["total_output_tokens"] == sum(requested)
    assert m["total_input_tokens"] == sum(len(b["prompt"]) for b in measured)
    assert all(len(r.itl) == r.output_tokens - 1 for r in result.records)
    # lower bounds are the server's own delays; upper ones leave room for a loaded machine
    assert TTFT_S * 1000 <= m["mean_ttft_ms"] < TTFT_S * 1000 + 100
    assert ITL_S * 1000 - 5 <= m["median_itl_ms"] < ITL_S * 1000 + 40
    assert m["mean_tpot_ms"] == pytest.approx(m["mean_itl_ms"], rel=0.2)
    assert state.peak_streams == 4
    body = state.bodies[0]
    assert body["stream"] is True and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True}
    assert all(3 <= i < 2048 for i in body["prompt"])
    table = format_table(result)
    assert "Serving Benchmark Result" in table and "P50 ITL (ms):" in table


def test_end_to_end_counts_chunks_without_usage() -> None:
    """Without a usage chunk, output tokens are the content chunks, not the finish-only one."""
    result, state = _with_fake_server(
        lambda url: BenchConfig(
            base_url=url, model="no-usage", num_prompts=3, random_output_len=4, request_rate=50.0
        )
    )
    assert len(state.bodies) == 3
    assert [r.output_tokens for r in result.records] == [4, 4, 4]
    assert all(len(r.itl) == 3 and statistics.median(r.itl) > ITL_S / 2 for r in result.records)
    assert result.metrics["total_output_tokens"] == 12


def test_end_to_end_failures_reported() -> None:
    """HTTP errors and refused connections become failed requests with the first error kept."""
    result, _ = _with_fake_server(
        lambda url: BenchConfig(base_url=url, model="broken", num_prompts=3, random_output_len=2)
    )
    assert result.metrics["failed"] == 3 and result.metrics["completed"] == 0
    assert result.metrics["first_error"].startswith("HTTP 500")
    assert "First error: HTTP 500" in format_table(result)

    async def refused() -> BenchmarkResult:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()  # the port is now free and nothing listens on it
        return await run_benchmark(
            BenchConfig(base_url=f"http://127.0.0.1:{port}", model="m", num_prompts=2)
        )

    m = asyncio.run(refused()).metrics
    assert m["failed"] == 2 and "ConnectError" in m["first_error"]


def test_cli_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`main` prints the table and writes every metric and per-request record to --json."""
    out = tmp_path / "result.json"

    async def serve_and_run() -> int:
        state = FakeServerState(bodies=[])
        server, port = await _fake_openai_server(state)
        try:
            argv = ["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "2"]
            argv += ["--random-output-len", "3", "--goodput", "ttft:1000", "--json", str(out)]
            # main runs its own event loop, so it runs in a thread beside this one.
            return await asyncio.to_thread(main, argv)
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(serve_and_run()) == 0
    data = json.loads(out.read_text())
    assert data["metrics"]["completed"] == 2
    assert data["metrics"]["request_goodput"] > 0
    assert data["config"]["request_rate"] == "inf"
    assert len(data["requests"]) == 2 and data["requests"][0]["output_tokens"] == 3
    assert "Request goodput (req/s):" in capsys.readouterr().out


def test_server_cpu_counts_the_process_and_its_descendants() -> None:
    """`--server-pid`'s reading: the CPU of a process and of every process under it (the
    engine's API process and its EngineCore), each by pid."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    burn += "time.sleep(60)"
    spawn = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"
    parent = subprocess.Popen([sys.executable, "-c", spawn])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            seen = server_cpu(parent.pid)
            if len(seen) == 2 and max(seen.values()) >= 0.3:
                break
            time.sleep(0.05)
        assert len(seen) == 2 and parent.pid in seen
        (child,) = set(seen) - {parent.pid}
        assert seen[child] >= 0.3 > seen[parent.pid]  # the child burnt it, not the parent
    finally:
        for pid in server_cpu(parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.wait()


def test_cli_prints_the_servers_cpu_per_token(capsys: pytest.CaptureFixture[str]) -> None:
    """With `--server-pid` (here this process, which serves the fake server) the report ends
    with the CPU the server's processes spent over the run and the API's per output token."""

    async def serve_and_run() -> int:
        state = FakeServerState(bodies=[])
        server, port = await _fake_openai_server(state)
        try:
            argv = ["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "4"]
            argv += ["--random-output-len", "5", "--server-pid", str(os.getpid())]
            return await asyncio.to_thread(main, argv)
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(serve_and_run()) == 0
    out = capsys.readouterr().out
    per_token = next(line for line in out.splitlines() if "API CPU per output token" in line)
    assert float(per_token.split()[-1]) > 0  # this process served 20 tokens
    assert "API process CPU (s):" in out


# ---------------------------------------------------------------- offline baseline


class _FakeLLM:
    """Stands in for `baton.LLM`: records its arguments and returns max_tokens token ids."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.model, self.engine_args = model, engine_args
        self.calls: list[tuple[list[dict[str, Any]], list[Any]]] = []

    def generate(self, prompts: list[dict[str, Any]], params: list[Any]) -> list[Any]:
        self.calls.append((prompts, params))
        return [
            SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5] * p.max_tokens)]) for p in params
        ]


def _fake_sampling_params(**kwargs: Any) -> SimpleNamespace:
    return SimpleNamespace(**kwargs)


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[_FakeLLM]:
    """Every `baton.LLM` the offline baseline makes, fakes that record their calls."""
    made: list[_FakeLLM] = []

    def make_llm(model: str, **engine_args: Any) -> _FakeLLM:
        made.append(_FakeLLM(model, **engine_args))
        return made[-1]

    monkeypatch.setattr(baton, "LLM", make_llm, raising=False)
    monkeypatch.setattr(baton, "SamplingParams", _fake_sampling_params, raising=False)
    return made


def test_offline_baseline_sends_same_requests(made: list[_FakeLLM]) -> None:
    """The offline run feeds baton.LLM the same token ids, greedy with ignore_eos, and counts
    every generated token; max_model_len defaults to the longest request."""
    reqs = sample_random_requests(6, 10, 4, 0.5, vocab_size=64, seed=1)
    tokens, seconds = offline_engine("/models/x", reqs, max_model_len=None)(reqs)
    (llm,) = made
    assert llm.model == "/models/x"
    assert llm.engine_args == {
        "max_model_len": max(len(r.prompt_token_ids) + r.max_tokens for r in reqs)
    }
    prompts, params = llm.calls[-1]  # the first call is the warm-up
    assert prompts == [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    assert [p.max_tokens for p in params] == [r.max_tokens for r in reqs]
    assert all(p.temperature == 0 and p.ignore_eos for p in params)
    assert tokens == sum(r.max_tokens for r in reqs) and seconds > 0


def test_offline_baseline_runs_at_the_servers_concurrency(made: list[_FakeLLM]) -> None:
    """With a cap on the requests in flight, the offline engine runs at most that many at a
    time (its `max_num_seqs`), as the server did; without one, at its own default."""
    reqs = sample_random_requests(6, 10, 4, 0.5, vocab_size=64, seed=1)
    offline_engine("/models/x", reqs, max_model_len=64, max_num_seqs=4)
    offline_engine("/models/x", reqs, max_model_len=64)
    assert [llm.engine_args for llm in made] == [
        {"max_model_len": 64, "max_num_seqs": 4},
        {"max_model_len": 64},
    ]


def test_repeats_alternate_the_server_and_one_offline_engine(
    made: list[_FakeLLM], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--repeats 3 --offline-baseline`: three server runs, each followed by an offline run of
    the same requests on one engine built once, as the server's (its concurrency, max_model_len
    and KV cache's blocks), each round with prompts of its own (repeated ones would hit the
    prefix caches); each round's ratio is printed and recorded, and the ratio reported is their
    median."""
    out = tmp_path / "result.json"
    state = FakeServerState(bodies=[])

    async def serve_and_run() -> int:
        server, port = await _fake_openai_server(state)
        try:
            argv = ["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "2"]
            argv += ["--random-output-len", "3", "--max-concurrency", "2", "--repeats", "3"]
            argv += ["--offline-baseline", "--model-path", "/models/x", "--json", str(out)]
            return await asyncio.to_thread(main, argv)
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(serve_and_run()) == 0
    (llm,) = made  # built once, for every round
    # The server's concurrency, length and KV cache: the same engine on both sides.
    assert llm.engine_args == {
        "max_num_seqs": 2,
        "max_model_len": 512,
        "num_gpu_blocks_override": 77,
    }
    assert len(llm.calls) == 1 + 3  # its warm-up, then one run per round
    assert len(state.bodies) == 3 * 2  # each round sent the two requests to the server
    served = [sorted(tuple(b["prompt"]) for b in state.bodies[i : i + 2]) for i in (0, 2, 4)]
    offline_prompts = [
        sorted(tuple(p["prompt_token_ids"]) for p in prompts) for prompts, _ in llm.calls[1:]
    ]
    assert offline_prompts == served and len({tuple(r) for r in served}) == 3
    offline = json.loads(out.read_text())["offline"]
    ratios = [r["online_to_offline_ratio"] for r in offline["rounds"]]
    assert len(ratios) == 3 and offline["online_to_offline_ratio"] == statistics.median(ratios)
    for r in offline["rounds"]:
        assert r["output_tokens"] == 2 * 3
        assert r["online_to_offline_ratio"] == pytest.approx(
            r["online_output_throughput"] / r["output_throughput"]
        )
    printed = capsys.readouterr().out
    assert printed.count("Offline Baseline") == 3 and "3 alternated rounds" in printed
