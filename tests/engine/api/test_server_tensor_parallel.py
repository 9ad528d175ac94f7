"""End to end: an engine server with --tensor-parallel-size 2 shows its layout, serves, and
goes down cleanly (503, non-zero exit) when one of its worker processes is killed."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.engine_server import NAME, start_server, streams_after
from tests.support.procs import children, engine_core_pid

pytestmark = pytest.mark.slow  # a server and two worker processes: seconds to start


def _worker_pids(server_pid: int) -> list[int]:
    core = engine_core_pid(server_pid)
    return [
        pid
        for pid in children(core)
        if b"baton.engine.executor.worker_proc" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def test_killing_a_worker_fails_streams_and_exits_nonzero(model: Path, tmp_path: Path) -> None:
    """/health and /metrics report tensor_parallel_size 2; after SIGKILL to one worker every
    open stream ends with an error within seconds, /health says 503 or the server is gone,
    and the server exits non-zero leaving no worker behind."""
    s = start_server(model, tmp_path, "--tensor-parallel-size", "2")
    workers = _worker_pids(s.proc.pid)
    try:
        assert len(workers) == 2
        assert httpx.get(f"{s.url}/health").json()["tensor_parallel_size"] == 2
        assert s.metrics()['baton:engine_parallel_info{tensor_parallel_size="2"}'] == 1
        done = s.client().completions.create(model=NAME, prompt="hello", max_tokens=4)
        assert done.choices[0].finish_reason in ("length", "stop")

        errors = streams_after(s, lambda: os.kill(workers[1], signal.SIGKILL))
        assert all(isinstance(e, openai.APIError) for e in errors), errors
        with contextlib.suppress(httpx.TransportError):  # already gone: as good
            assert httpx.get(f"{s.url}/health", timeout=2).status_code == 503
        assert s.proc.wait(10) != 0
        deadline = time.monotonic() + 5
        while any(Path(f"/proc/{pid}").exists() for pid in workers):
            assert time.monotonic() < deadline, "a worker outlived its engine"
            time.sleep(0.05)
    finally:
        s.stop()
