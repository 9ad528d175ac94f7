"""Servers for the router's tests: any ASGI app under uvicorn in a thread (fake engines, the
router itself) on a free 127.0.0.1 port, and a router in front of fake engines."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Literal

import httpx
import uvicorn
from starlette.types import ASGIApp

from baton.router.app import build_app
from baton.router.config import RouterConfig
from baton.router.discovery import Endpoint, Role, StaticDiscovery
from baton.router.router import Router
from tests.router.fake_engine import FakeEngine, LeaseBoard

# Fast health checks, so tests see ejection and recovery in a fraction of a second.
FAST = RouterConfig(health_interval=0.05, health_timeout=1.0, eject_seconds=0.3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ThreadServer:
    """uvicorn serving `app` in a thread with its own event loop."""

    def __init__(
        self, app: ASGIApp, port: int | None = None, lifespan: Literal["on", "off"] = "off"
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan=lifespan,
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.server.serve())

    def start(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stops listening and closes every connection (open streams are cut)."""
        self.server.should_exit = True
        self.server.force_exit = True
        self.thread.join(10)


class FakeCluster:
    """Fake engines by role, each served on its own port, sharing one lease board."""

    def __init__(self) -> None:
        self.board = LeaseBoard()
        self.engines: list[tuple[FakeEngine, ThreadServer]] = []

    def add(self, role: Role = "both", model: str = "fake") -> tuple[FakeEngine, ThreadServer]:
        engine = FakeEngine(model, role, self.board)
        server = ThreadServer(engine.app).start()
        engine.port = server.port
        self.engines.append((engine, server))
        return engine, server

    def endpoints(self) -> list[Endpoint]:
        return [Endpoint(s.url, e.role) for e, s in self.engines]

    def stop(self) -> None:
        for _, server in self.engines:
            if server.thread.is_alive():
                server.stop()


class RouterServer(ThreadServer):
    """A router in a thread in front of `endpoints`."""

    def __init__(self, endpoints: Sequence[Endpoint], config: RouterConfig) -> None:
        self.router = Router(config)
        super().__init__(build_app(self.router, StaticDiscovery(endpoints)), lifespan="on")

    def stop(self) -> None:
        """A graceful stop: the app's shutdown closes discovery, health checks, connections."""
        self.server.should_exit = True
        self.thread.join(10)

    def wait_ready(self, available: int | None = None, timeout: float = 10) -> None:
        """Until /health is 200 and (if given) `available` engines are in rotation."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = httpx.get(f"{self.url}/health", timeout=2)
            if r.status_code == 200 and available in (None, r.json()["available"]):
                return
            time.sleep(0.02)
        raise AssertionError(f"router not ready: {httpx.get(f'{self.url}/engines').text}")

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of the router's /metrics (0 when absent)."""
        return scrape(self.url, name, **labels)


def scrape(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` at `url`/metrics whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        key, value = line.rsplit(" ", 1)
        sample, _, rest = key.partition("{")
        if sample != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total


@contextmanager
def routed(
    cluster: FakeCluster, config: RouterConfig = FAST, **overrides: Any
) -> Iterator[RouterServer]:
    """A started router in front of `cluster`'s engines, all in rotation; stopped after."""
    server = RouterServer(cluster.endpoints(), replace(config, **overrides))
    server.start()
    try:
        server.wait_ready(available=len(cluster.engines))
        yield server
    finally:
        server.stop()
