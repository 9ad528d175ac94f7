"""Any ASGI app (a fake engine, the router itself) under uvicorn in a thread of the test
process, on a free 127.0.0.1 port, and the scrape of one metric from a /metrics page."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Literal

import httpx
import uvicorn
from starlette.types import ASGIApp

from tests.support.ports import free_port


class ThreadServer:
    """uvicorn serving `app` in a thread with its own event loop."""

    def __init__(
        self,
        app: ASGIApp,
        port: int | None = None,
        lifespan: Literal["on", "off"] = "off",
        protocol: type[asyncio.Protocol] | None = None,
    ) -> None:
        """`protocol`: uvicorn's `http=` (Baton's servers': `baton.http_server.protocol_class`),
        else uvicorn's own."""
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
            http=protocol or "auto",
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
