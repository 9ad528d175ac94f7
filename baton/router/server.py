"""Running the router: the app under uvicorn until SIGINT or SIGTERM (uvicorn's graceful
shutdown lets open streams finish, then discovery, health checks and connections close)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import prometheus_client
import uvicorn

from baton.http_timeouts import DEFAULT_READ_TIMEOUT, read_timeout_protocol
from baton.router.app import build_app
from baton.router.config import RouterConfig
from baton.router.discovery import Discovery
from baton.router.router import Router

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ListenConfig:
    """Where the router listens and how its HTTP server logs and stops."""

    host: str = "0.0.0.0"
    port: int = 8000
    shutdown_timeout: float = 30.0  # seconds open requests get after SIGTERM
    request_read_timeout: float = DEFAULT_READ_TIMEOUT  # seconds a client has to send a request
    access_log: bool = False
    uvicorn_log_level: str = "warning"

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.request_read_timeout <= 0:
            raise ValueError(f"request_read_timeout must be > 0, got {self.request_read_timeout}")


def uvicorn_config(router: Router, discovery: Discovery, listen: ListenConfig) -> uvicorn.Config:
    return uvicorn.Config(
        build_app(router, discovery),
        host=listen.host,
        port=listen.port,
        http=read_timeout_protocol(listen.request_read_timeout),  # httptools; slow clients dropped
        lifespan="on",
        access_log=listen.access_log,
        log_level=listen.uvicorn_log_level,
        timeout_graceful_shutdown=int(listen.shutdown_timeout),
    )


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling (which re-raises the signal at exit, so a
    clean SIGTERM stop would end with -15): `run_router` handles SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def run_router(config: RouterConfig, discovery: Discovery, listen: ListenConfig) -> int:
    """Serves until SIGINT or SIGTERM (a second one cuts open streams); the exit code."""
    # vLLM's expositions have no `_created` series; a process-wide switch, so only here.
    prometheus_client.disable_created_metrics()
    server = _Uvicorn(uvicorn_config(Router(config), discovery, listen))
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if server.should_exit:
            server.force_exit = True
        logger.info("%s: stopping the router", sig.name)
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await server.serve()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0 if server.started else 1


def serve(config: RouterConfig, discovery: Discovery, listen: ListenConfig) -> int:
    """Serves until stopped, on uvloop where it is installed; returns the exit code."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run_router(config, discovery, listen))
    return uvloop.run(run_router(config, discovery, listen))
