"""The router's test harness: fake engines served in threads (a cluster sharing one lease
board), and a router in a thread in front of them with fast health checks."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import httpx

from baton.http_server import protocol_class
from baton.router.app import build_app
from baton.router.config import RouterConfig
from baton.router.discovery import Endpoint, Role, StaticDiscovery
from baton.router.router import Router
from tests.support.fake_engine import FakeEngine, LeaseBoard
from tests.support.thread_server import ThreadServer, scrape

# Fast health checks, so tests see ejection and recovery in a fraction of a second.
FAST = RouterConfig(health_interval=0.05, health_timeout=1.0, eject_seconds=0.3)


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

    def __init__(
        self, endpoints: Sequence[Endpoint], config: RouterConfig, direct_writes: bool = True
    ) -> None:
        """`direct_writes`: served as `baton router` serves it (stream chunks written past
        the ASGI `send`); False: by uvicorn's own protocol, every chunk through `send`."""
        self.router = Router(config)
        app = build_app(self.router, StaticDiscovery(endpoints))
        protocol = protocol_class() if direct_writes else None
        super().__init__(app, lifespan="on", protocol=protocol)

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


@contextmanager
def routed(
    cluster: FakeCluster, config: RouterConfig = FAST, direct_writes: bool = True, **overrides: Any
) -> Iterator[RouterServer]:
    """A started router in front of `cluster`'s engines, all in rotation; stopped after."""
    server = RouterServer(cluster.endpoints(), replace(config, **overrides), direct_writes)
    server.start()
    try:
        server.wait_ready(available=len(cluster.engines))
        yield server
    finally:
        server.stop()
