"""Running the router: the app under the shared HTTP server until SIGINT or SIGTERM (uvicorn's
graceful shutdown lets open streams finish, then discovery, health checks and connections
close). Requests held for an engine (`hold`) are answered 503 at the signal: no engine will come
for them here, and their clients can retry on another replica at once."""

from __future__ import annotations

import logging
import signal

from baton.http_server import HTTPServer, ListenConfig, freeze_startup_heap, run
from baton.router.app import build_app
from baton.router.config import RouterConfig
from baton.router.discovery import Discovery
from baton.router.router import Router

logger = logging.getLogger(__name__)


async def run_router(config: RouterConfig, discovery: Discovery, listen: ListenConfig) -> int:
    """Serves until SIGINT or SIGTERM (a second one cuts open streams); the exit code."""
    router = Router(config)
    http = HTTPServer(
        build_app(router, discovery),
        listen,
        lifespan="on",  # starts discovery, and closes the router at the end
        graceful_shutdown=listen.shutdown_timeout,
    )

    def on_signal(sig: signal.Signals) -> None:
        logger.info("%s: stopping the router", sig.name)
        router.holds.close()
        http.stop(force=http.stopping)

    freeze_startup_heap()
    with http.handle_signals(on_signal):
        await http.serve()
    return 0 if http.started else 1


def serve(config: RouterConfig, discovery: Discovery, listen: ListenConfig) -> int:
    """Serves until stopped; returns the exit code."""
    return run(lambda: run_router(config, discovery, listen))
