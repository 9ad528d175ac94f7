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

READ_TIMEOUT = 2.0  # --request-read-timeout of every router here: slow clients go quickly


class RouterProcess:
    """`baton router` in a process in front of `prefill` and `decode` URLs."""

    def __init__(self, log: Path, prefill: list[str], decode: list[str], *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        engines = [w for u in prefill for w in ("--prefill", u)]
        engines += [w for u in decode for w in ("--decode", u)]
        cmd = [sys.executable, "-m", "baton.cli", "--log-level", "WARNING", "router",
               "--host", "127.0.0.1", "--port", str(self.port), "--health-interval", "0.5",
               "--request-read-timeout", str(READ_TIMEOUT), *engines, *flags]  # fmt: skip
        self.expected = len(engines) // 2
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"router exited:\n{self.log()}"
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = httpx.get(f"{self.url}/health", timeout=1)
                if r.status_code == 200 and r.json()["available"] == self.expected:
                    return
            time.sleep(0.1)
        raise AssertionError(f"router not ready after {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
