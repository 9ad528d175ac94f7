"""The real engine server (`python -m baton.engine.api.cli`) in a subprocess on a free
127.0.0.1 port: started alone or several side by side, stopped alone or all at once, with the
checks the end-to-end tests make of it (metrics, error bodies, streams cut by a fault)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.ports import free_port
from tests.support.procs import children, listens, opened, port_taken

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 1024
NAME = "tiny"
# Engines started side by side share the cores, so a start allows this long per engine; a
# loaded CI machine can take a minute for one.
READY_SECONDS_EACH = 90.0


class Server:
    """`python -m baton.engine.api.cli` on a free port; its output goes to a log file."""

    def __init__(self, model: Path, log: Path, *flags: str) -> None:
        self.model, self.flags, self.log_path = model, flags, log
        self._start("wb")

    scheme = "http"

    def _start(self, mode: str = "ab") -> None:
        """Starts the server on a port picked now. The port is named before the server binds it
        (after its engine is ready), and another process may pick the same number meanwhile."""
        self.port = free_port()
        self.url = f"{self.scheme}://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "baton.engine.api.cli",
            "--model", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", NAME,
            "--disable-uvicorn-access-log", "--log-level", "WARNING", *self.flags,
        ]  # fmt: skip
        with open(self.log_path, mode) as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        self._taken_before = port_taken(self.log_path)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until this server answers /health from its own socket. One that cannot bind its port
        (another process took the number first; a ready answer there is that process's)
        starts again on another."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if port_taken(self.log_path) > self._taken_before:
                    self._start()
                    continue
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                ok = self._health().status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok and listens(self.proc.pid, self.port):
                return
            time.sleep(0.2)
        pytest.fail(f"server not ready after {timeout} s:\n{self.log()}")

    def _health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=1)

    def stop(self, drain_seconds: float = 5) -> None:
        """SIGTERM (drain); a second SIGTERM if it is still draining after `drain_seconds` (a
        lease a test left unclaimed would hold it for the lease time: the second signal stops it
        at once); SIGKILL for the server and its children if it lingers 5 s even then."""
        if self.proc.poll() is None:
            kids = opened(children(self.proc.pid))
            for wait in (drain_seconds, 5):
                self.proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(wait)
                    break
            else:
                self.proc.kill()
                self.proc.wait(5)
            for kid in kids:
                kid.signal(signal.SIGKILL)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def metrics(self) -> dict[str, float]:
        """`name{other labels}` → value; the model_name and engine labels are checked, then
        left out of the key. The families vLLM labels otherwise (the HTTP metrics, the cache
        config info) are left out."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        values = {}
        for line in text.splitlines():
            if not line or line.startswith(("#", "http_", "vllm:cache_config_info")):
                continue
            key, value = line.rsplit(" ", 1)
            name, _, labels = key.partition("{")
            pairs = [x for x in labels.rstrip("}").split(",") if x]
            assert 'model_name="tiny"' in pairs and 'engine="0"' in pairs, line
            rest = [x for x in pairs if x not in ('model_name="tiny"', 'engine="0"')]
            values[f"{name}{{{','.join(rest)}}}"] = float(value)
        return values


def start_server(model: Path, tmp: Path, *flags: str) -> Server:
    """A ready server with `flags`, logging under `tmp`; stopped again if it never gets ready."""
    name = f"server-{time.monotonic_ns()}"
    return start_all(model, tmp, {name: flags})[name]


def start_all(model: Path, tmp: Path, flags: Mapping[str, Sequence[str]]) -> dict[str, Server]:
    """Ready servers by name, each with its flags and a log `tmp/<name>.log`. They start side by
    side, so their EngineCores load the model on both cores at once; if one never gets ready,
    all are stopped."""
    servers: dict[str, Server] = {}
    try:
        for name, extra in flags.items():
            servers[name] = Server(model, tmp / f"{name}.log", *extra)
        timeout = READY_SECONDS_EACH * len(servers)
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(lambda s: s.wait_ready(timeout), servers.values()))
    except BaseException:
        stop_all(servers.values())
        raise
    return servers


def stop_all(servers: Iterable[Server], drain_seconds: float = 5) -> None:
    """Stops every server at once: each drain and exit takes seconds of waiting, not of CPU.
    Fixtures whose tests leave leases unclaimed on purpose pass a short `drain_seconds`: the
    drain would only wait those leases out."""
    servers = list(servers)
    if servers:
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(lambda s: s.stop(drain_seconds), servers))


def expect_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The `error` object of an OpenAI-shaped error response with `status`."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["object"] == "error" and body["error"]["code"] == status
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


def streams_after(server: Server, kill: Callable[[], None], timeout: float = 5) -> list[Any]:
    """Opens 3 long streams, reads a chunk of each, calls `kill`, then reads them out: what
    each ended with (an `openai.APIError`, or None if it finished), within `timeout` s."""

    async def go() -> list[BaseException | None]:
        async with server.async_client() as client:
            streams = [
                await client.completions.create(
                    model=NAME,
                    prompt=f"doomed {i}",
                    max_tokens=1000,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for i in range(3)
            ]
            iterators = [aiter(st) for st in streams]
            for it in iterators:
                await anext(it)
            kill()

            async def drain(it: Any) -> BaseException | None:
                try:
                    async for _ in it:
                        pass
                except openai.APIError as e:
                    return e
                return None

            return await asyncio.wait_for(
                asyncio.gather(*(drain(it) for it in iterators)), timeout=timeout
            )

    return asyncio.run(go())
