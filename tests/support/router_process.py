"""`baton router` in a subprocess on a free 127.0.0.1 port, in front of engine URLs."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.engine_server import ROOT
from tests.support.ports import free_port
from tests.support.procs import listens, port_taken

READ_TIMEOUT = 2.0  # --request-read-timeout of every router here: slow clients go quickly


class RouterProcess:
    """`baton router` in a process in front of `prefill` and `decode` URLs."""

    scheme = "http"

    def __init__(self, log: Path, prefill: list[str], decode: list[str], *flags: str) -> None:
        self.log_path = log
        engines = [w for u in prefill for w in ("--prefill", u)]
        engines += [w for u in decode for w in ("--decode", u)]
        self._args = [*engines, *flags]
        self.expected = len(engines) // 2
        self._start("wb")

    def _start(self, mode: str = "ab") -> None:
        """Starts the router on a port picked now; another process may pick the same number
        before the router binds it."""
        self.port = free_port()
        self.url = f"{self.scheme}://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "baton.cli", "--log-level", "WARNING", "router",
               "--host", "127.0.0.1", "--port", str(self.port), "--health-interval", "0.5",
               "--request-read-timeout", str(READ_TIMEOUT), *self._args]  # fmt: skip
        with open(self.log_path, mode) as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        self._taken_before = port_taken(self.log_path)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = 30) -> None:
        """Until the router answers /health from its own socket with every engine available;
        one that found its port taken starts again on another."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if port_taken(self.log_path) > self._taken_before:
                    self._start()
                    continue
                raise AssertionError(f"router exited:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = self._health()
                ready = r.status_code == 200 and r.json()["available"] == self.expected
                if ready and listens(self.proc.pid, self.port):
                    return
            time.sleep(0.1)
        raise AssertionError(f"router not ready after {timeout} s:\n{self.log()}")

    def _health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
