"""End to end: the real engine server under load and in trouble: 200 concurrent streams and
client aborts, SIGTERM drain, and the death of its EngineCore process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.engine_server import (
    NAME,
    Server,
    expect_error,
    start_server,
    streams_after,
)
from tests.support.procs import engine_core_pid

pytestmark = pytest.mark.slow  # every test here needs a server process: seconds to start


# ---- load, aborts, shutdown, death ---------------------------------------------------------


def _wait_idle(server: Server, seconds: float) -> dict[str, float]:
    deadline = time.monotonic() + seconds
    while True:
        m = server.metrics()
        idle = m["vllm:num_requests_running{}"] == 0 and m["vllm:num_requests_waiting{}"] == 0
        if idle and m["vllm:kv_cache_usage_perc{}"] == 0:
            return m
        assert time.monotonic() < deadline, f"not idle after {seconds} s: {m}"
        time.sleep(0.05)


def test_client_gone_aborts_a_non_streaming_request(server: Server) -> None:
    """A non-streaming client that disconnects (times out) gets its request aborted."""
    aborts = 'vllm:request_success_total{finished_reason="abort"}'
    before = server.metrics()[aborts]

    async def go() -> None:
        async with httpx.AsyncClient(timeout=0.3) as client:

            async def one(i: int) -> None:
                body = {"prompt": f"impatient {i}", "max_tokens": 1000, "ignore_eos": True}
                with pytest.raises(httpx.TimeoutException):
                    await client.post(f"{server.url}/v1/completions", json=body)

            await asyncio.gather(*(one(i) for i in range(8)))

    asyncio.run(go())
    # Left running, the 8 would end with finish_reason "length"; all 8 ended as aborts.
    m = _wait_idle(server, 10)
    assert m[aborts] - before == 8


def test_200_streams_complete_and_50_aborts_free_the_cache(server: Server) -> None:
    """200 concurrent streams all finish; 50 more closed mid-stream are aborted in the engine,
    leaving nothing running and the KV cache back at idle."""
    aborted_before = server.metrics().get('vllm:request_success_total{finished_reason="abort"}', 0)

    async def go() -> tuple[list[str | None], int]:
        async with server.async_client() as client:

            async def full(i: int) -> str | None:
                stream = await client.completions.create(
                    model=NAME, prompt=f"stream {i}", max_tokens=6, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                finish = None
                async for chunk in stream:
                    finish = chunk.choices[0].finish_reason or finish
                return finish

            async def abort(i: int) -> int:
                stream = await client.completions.create(
                    model=NAME, prompt=f"abort {i}", max_tokens=1000, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                async for _ in stream:
                    break
                await stream.close()
                return 1

            results = await asyncio.gather(
                *(full(i) for i in range(200)), *(abort(i) for i in range(50))
            )
        return [r for r in results[:200] if not isinstance(r, int)], sum(results[200:])  # type: ignore[arg-type]

    finishes, num_aborted = asyncio.run(go())
    assert finishes == ["length"] * 200 and num_aborted == 50
    # Left running, the 50 would take ~10 s more on two CPU cores: idle sooner means aborted.
    m = _wait_idle(server, 3)
    aborted = m['vllm:request_success_total{finished_reason="abort"}'] - aborted_before
    assert aborted == 50


def test_sigterm_drains_in_flight_then_exits_zero(model: Path, tmp_path: Path) -> None:
    """After SIGTERM new requests get 503 while in-flight streams finish; then exit code 0."""
    s = start_server(model, tmp_path, "--shutdown-timeout", "30")
    try:
        client = s.client()
        stream = client.completions.create(
            model=NAME, prompt="drain me", max_tokens=1000, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        first = next(chunks)
        s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2
        while httpx.get(f"{s.url}/health").status_code != 503:
            assert time.monotonic() < deadline, "still healthy after SIGTERM"
            time.sleep(0.01)
        expect_error(httpx.post(f"{s.url}/v1/completions", json={"prompt": "late"}), 503)
        rest = list(chunks)
        text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
        assert rest[-1].choices[0].finish_reason == "length" and text
        assert s.proc.wait(20) == 0
    finally:
        s.stop()


def test_a_second_sigterm_stops_a_drain_waiting_for_leases(model: Path, tmp_path: Path) -> None:
    """A prefill engine drains its leases after SIGTERM (here one nobody will claim, for 30 s);
    a second SIGTERM ends that wait and the process exits at once."""
    s = start_server(model, tmp_path, "--role", "prefill", "--kv-lease-seconds", "30")
    try:
        body = {
            "prompt": "leased",
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        answer = httpx.post(f"{s.url}/v1/completions", json=body).json()
        assert answer["kv_transfer_params"]["remote_block_ids"]
        s.proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):  # waiting for the lease
            s.proc.wait(1.5)
        s.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        s.proc.wait(10)
        assert time.monotonic() - start < 3
    finally:
        s.stop()


def test_engine_core_death_fails_open_requests_and_exits_nonzero(
    model: Path, tmp_path: Path
) -> None:
    """Killing the EngineCore mid-stream ends every open stream with an error within seconds,
    and the server process exits non-zero."""
    s = start_server(model, tmp_path)
    try:
        errors = streams_after(s, lambda: os.kill(engine_core_pid(s.proc.pid), signal.SIGKILL))
        assert all(isinstance(e, openai.APIError) for e in errors), errors
        assert all("engine" in str(e) for e in errors), errors
        assert s.proc.wait(10) != 0
    finally:
        s.stop()
