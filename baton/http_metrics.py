"""HTTP request metrics as vLLM exposes them (prometheus-fastapi-instrumentator's defaults), for
dashboards built on vLLM's /metrics: `http_requests_total{method,status,handler}` and
`http_request_duration_seconds{method,handler}`.

`handler` is the matched route's path template ("none" when no route matched: a 404, or an
answer given before routing, such as a 413 for a body too large), `status` the status class
("2xx", "4xx", ...), the duration from the request's arrival to the end of its response body.
A pure ASGI middleware rather than the instrumentator: per request it costs two clock reads, a
`send` wrapper and a dictionary look-up of the label children.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# What vLLM leaves out: the scrape itself and the probes.
EXCLUDED_PATHS = frozenset(("/metrics", "/health", "/load", "/ping", "/version", "/server_info"))
_STATUS_CLASSES = ("0xx", "1xx", "2xx", "3xx", "4xx", "5xx")
# Other methods are counted as "other": a client may send any token as a method, and each new
# one would be another series.
_METHODS = frozenset(("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"))
_UNTEMPLATED = "none"  # the instrumentator's handler for requests no route matched


class HTTPMetrics:
    """Counts and times every HTTP request but those to `excluded` paths, into `registry`."""

    def __init__(
        self,
        app: ASGIApp,
        registry: CollectorRegistry,
        excluded: frozenset[str] = EXCLUDED_PATHS,
    ) -> None:
        self.app = app
        self.excluded = excluded
        self._total = Counter(
            "http_requests_total",
            "Total number of requests by method, status and handler.",
            ["method", "status", "handler"],
            registry=registry,
        )
        self._duration = Histogram(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler. Made to be only used if aggregation by "
            "handler is important.",
            ["method", "handler"],
            buckets=(0.1, 0.5, 1.0),
            registry=registry,
        )
        # (method, status class, handler) -> the two label children, made once each.
        self._children: dict[tuple[str, int, str], tuple[Counter, Histogram]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.excluded:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # no answer began: an exception, which the outermost handler makes a 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self._observe(scope, status, time.perf_counter() - start)

    def _observe(self, scope: Scope, status: int, seconds: float) -> None:
        # The router puts the matched route in the scope, which it shares with us.
        route = scope.get("route")
        handler = getattr(route, "path", _UNTEMPLATED) if route is not None else _UNTEMPLATED
        method = scope["method"] if scope["method"] in _METHODS else "other"
        status_class = min(max(status // 100, 0), 5)
        key = (method, status_class, handler)
        children = self._children.get(key)
        if children is None:
            children = (
                self._total.labels(method, _STATUS_CLASSES[status_class], handler),
                self._duration.labels(method, handler),
            )
            self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)
