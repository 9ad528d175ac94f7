"""Process stacks for the fuzz and load tests: an aggregated engine, or a router in front of one
prefill and one decode engine, each a real process on a free 127.0.0.1 port, and the resident
memory of each process (API servers and their EngineCore children)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.engine_server import Server, start_all, stop_all
from tests.support.procs import alive, engine_core_pid, rss_bytes
from tests.support.router_process import READ_TIMEOUT, RouterProcess


def save_figures(name: str, figures: dict[str, Any]) -> None:
    """`BATON_RELIABILITY_RESULTS=folder` keeps a run's figures as `name`.json (for the docs)."""
    folder = os.environ.get("BATON_RELIABILITY_RESULTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, f"{name}.json").write_text(json.dumps(figures, indent=1, default=str))


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
    return start_all(model, tmp, {name: (*flags, *extra) for name, extra in roles.items()})


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
        stop_all(servers.values())


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
        # Hand-offs the fuzzer broke leave leases unclaimed: no need to wait them out.
        stop_all(servers.values(), drain_seconds=0.5)
