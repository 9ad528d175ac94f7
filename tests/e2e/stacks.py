"""Process stacks for the fuzz and load tests: an aggregated engine, or a router in front of one
prefill and one decode engine, each a real process on a free 127.0.0.1 port, and the resident
memory of each process (API servers and their EngineCore children)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.engine.api.server_fixtures import ROOT, Server, engine_core_pid
from tests.router.harness import free_port

READ_TIMEOUT = 2.0  # --request-read-timeout of every server here: slow clients go quickly


def save_figures(name: str, figures: dict[str, Any]) -> None:
    """`BATON_RELIABILITY_RESULTS=folder` keeps a run's figures as `name`.json (for the docs)."""
    folder = os.environ.get("BATON_RELIABILITY_RESULTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, f"{name}.json").write_text(json.dumps(figures, indent=1, default=str))


def rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def alive(pid: int) -> bool:
    """`pid` runs and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


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


@dataclass
class Stack:
    """The processes of one test stack; `url` is where clients go (router or engine)."""

    url: str
    engines: dict[str, Server]  # by name: "engine", or "prefill" and "decode"
    router: RouterProcess | None = None
    cores: dict[str, int] = field(default_factory=dict)  # EngineCore pid by engine name

    def pids(self) -> dict[str, int]:
        """Every process of the stack by name: `router`, `<engine>`, `<engine>-core`."""
        pids = {name: s.proc.pid for name, s in self.engines.items()}
        pids.update({f"{name}-core": pid for name, pid in self.cores.items()})
        if self.router is not None:
            pids["router"] = self.router.proc.pid
        return pids

    def rss(self) -> dict[str, int]:
        return {name: rss_bytes(pid) for name, pid in self.pids().items()}

    def dead(self) -> list[str]:
        """The processes of the stack that are gone."""
        return [name for name, pid in self.pids().items() if not alive(pid)]

    def logs(self) -> str:
        parts = [f"--- {n}:\n{s.log()}" for n, s in self.engines.items()]
        if self.router is not None:
            parts.append(f"--- router:\n{self.router.log()}")
        return "\n".join(parts)


def _start_engines(model: Path, tmp: Path, roles: dict[str, tuple[str, ...]]) -> dict[str, Server]:
    """Engines by name with their flags, started side by side (the cores load in parallel)."""
    flags = ("--request-read-timeout", str(READ_TIMEOUT))
    servers = {
        name: Server(model, tmp / f"{name}.log", *flags, *extra) for name, extra in roles.items()
    }
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(lambda s: s.wait_ready(120), servers.values()))
    except BaseException:
        for s in servers.values():
            s.stop()
        raise
    return servers


@contextmanager
def engine_stack(model: Path, tmp: Path, *flags: str) -> Iterator[Stack]:
    """One aggregated engine; stopped after."""
    servers = _start_engines(model, tmp, {"engine": flags})
    try:
        yield Stack(
            servers["engine"].url,
            servers,
            cores={"engine": engine_core_pid(servers["engine"].proc.pid)},
        )
    finally:
        servers["engine"].stop()


@contextmanager
def disagg_stack(model: Path, tmp: Path, *flags: str) -> Iterator[Stack]:
    """A router in front of one prefill and one decode engine; all stopped after."""
    servers = _start_engines(
        model,
        tmp,
        {"prefill": ("--role", "prefill", *flags), "decode": ("--role", "decode", *flags)},
    )
    router = RouterProcess(tmp / "router.log", [servers["prefill"].url], [servers["decode"].url])
    try:
        router.wait_ready()
        cores = {name: engine_core_pid(s.proc.pid) for name, s in servers.items()}
        yield Stack(router.url, servers, router, cores)
    finally:
        router.stop()
        for s in servers.values():
            s.stop()
