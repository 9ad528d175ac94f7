"""The drain's end: requests still in flight at `--shutdown-timeout` fail with a 503 (a stream
with an error event and `[DONE]`, which the router resumes elsewhere) instead of a cut
connection, and their engine requests are aborted (`AsyncLLM.fail_all`)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from baton.engine.api.server import DRAIN_TIMEOUT_MESSAGE
from baton.engine.async_llm import AsyncLLM
from baton.engine.config import EngineArgs
from baton.engine.sampling_params import SamplingParams
from baton.errors import APIError
from tests.support.engine_server import start_server
from tests.support.procs import engine_core

pytestmark = pytest.mark.slow  # a real engine (and a server process): seconds to start

LONG = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0}
# The exact end of a stream cut by the drain timeout: the router matches on these bytes.
DRAIN_END = (
    b'data: {"object": "error", "error": {"message": "the engine is shutting down (drain '
    b'timeout)", "type": "ServiceUnavailable", "param": null, "code": 503}}\n\n'
    b"data: [DONE]\n\n"
)


def test_the_drain_end_is_a_503_event_then_done() -> None:
    """The bytes a drained stream ends with are `APIError.sse()` of a 503, then `[DONE]`."""
    assert APIError(503, DRAIN_TIMEOUT_MESSAGE).sse() + b"data: [DONE]\n\n" == DRAIN_END


def test_fail_all_ends_streams_and_aborts_their_requests(model: Path) -> None:
    """`fail_all(error)` ends every open stream with `error`; the core aborts their requests
    (nothing runs, no KV block is held), and the engine serves the next request."""

    async def main() -> None:
        llm = await AsyncLLM.start(EngineArgs(model=str(model), max_model_len=1024))
        try:
            params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
            streams = [llm.generate(f"r{i}", [5, 6, i + 7], params) for i in range(3)]
            for stream in streams:
                await anext(stream)
            error = APIError(503, "going away")
            llm.fail_all(error)
            for stream in streams:
                with pytest.raises(APIError) as raised:
                    async for _ in stream:
                        pass
                assert raised.value is error
            deadline = time.monotonic() + 10
            while llm.stats.num_running or llm.stats.num_waiting or llm.stats.kv_cache_usage:
                assert time.monotonic() < deadline, f"not aborted: {llm.stats}"
                await asyncio.sleep(0.05)
            short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            outs = [out async for out in llm.generate("after", [5, 6], short)]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_drain_timeout_fails_open_requests_with_503(model: Path, tmp_path: Path) -> None:
    """SIGTERM with `--shutdown-timeout 1` while two streams and a non-streamed request run
    (their EngineCore stopped, so none can finish): after about a second each stream ends with
    the 503 error event and `[DONE]`, the other request gets a 503 answer, and the server
    exits 0."""
    s = start_server(model, tmp_path, "--shutdown-timeout", "1")
    core = engine_core(s.proc.pid)
    try:
        with httpx.Client(timeout=30) as client, ThreadPoolExecutor(1) as pool:
            whole = pool.submit(
                client.post, f"{s.url}/v1/completions", json={"prompt": "whole", **LONG}
            )
            streams = [
                client.stream(
                    "POST",
                    f"{s.url}/v1/completions",
                    json={"prompt": f"stream {i}", "stream": True, **LONG},
                )
                for i in range(2)
            ]
            responses = [cm.__enter__() for cm in streams]
            chunks = [r.iter_bytes() for r in responses]
            for it in chunks:
                assert b'"text"' in next(it)  # a token event: generation runs
            deadline = time.monotonic() + 10
            while s.metrics()["vllm:num_requests_running{}"] < 3:
                assert time.monotonic() < deadline, "the non-streamed request never ran"
                time.sleep(0.05)
            core.signal(signal.SIGSTOP)
            s.proc.terminate()
            start = time.monotonic()
            ends = [b"".join(it) for it in chunks]
            took = time.monotonic() - start
            answer = whole.result(10)
            for cm in streams:
                cm.__exit__(None, None, None)
        core.signal(signal.SIGCONT)
        for end in ends:
            assert end.endswith(DRAIN_END), end[-300:]
            assert all(b"error" not in e for e in end[: -len(DRAIN_END)].split(b"\n\n"))
        assert 0.9 < took < 8, took
        assert answer.status_code == 503, answer.text
        assert json.loads(answer.text)["error"]["message"] == DRAIN_TIMEOUT_MESSAGE
        assert s.proc.wait(20) == 0, s.log()
        assert "failing 3 requests with 503" in s.log()
    finally:
        core.signal(signal.SIGCONT)
        s.stop()
