"""The router's HTTP face: a FastAPI app with the engines' OpenAI routes in front of a `Router`.

Request bodies are read as raw JSON (not validated into models): the engines validate them and
their 400s pass through unchanged, and the router stays a thin, fast hop. A path or method no
route takes is a 404 or 405 in OpenAI's error shape. The app starts the router's discovery when
it starts serving and closes it when it stops.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import Response

from baton.errors import APIError
from baton.http_metrics import HTTPMetrics
from baton.http_server import CLIENT_CLOSED, ClientGone
from baton.router.discovery import Discovery
from baton.router.metrics import CONTENT_TYPE
from baton.router.router import Router
from baton.tracing import NO_NATIVE_TELEMETRY, RequestTracing

logger = logging.getLogger(__name__)


def _json(body: object, status: int = 200) -> Response:
    return Response(json.dumps(body), status_code=status, media_type="application/json")


async def _http_error(_: Request, error: Exception) -> Response:
    """No route for the path (404) or the method (405), in OpenAI's error shape."""
    assert isinstance(error, HTTPException)
    response = APIError(error.status_code, str(error.detail)).response()
    response.headers.update(error.headers or {})
    return response


def build_app(router: Router, discovery: Discovery | None = None) -> FastAPI:
    """The app serving `router`; `discovery`, when given, starts with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if discovery is not None:
            router.start(discovery)
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(
        title="Baton router",
        description="The cluster-wide OpenAI endpoint in front of Baton engines",
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},
        telemetry=NO_NATIVE_TELEMETRY,
    )
    app.state.router = router
    metrics = router.metrics

    def endpoint(
        route: str, handle: Callable[[str, Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """`handle`'s response, or the one of the error it raised, counted by route."""

        async def answer(request: Request) -> Response:
            try:
                response = await handle(route, request)
            except APIError as e:
                response = e.response()
            except ClientGone:
                response = Response(status_code=CLIENT_CLOSED)
            metrics.request(route, response.status_code)
            return response

        return answer

    async def generate(route: str, request: Request) -> Response:
        return await router.generate(await router.read(route, request))

    # Plain Starlette routes: FastAPI's dependency solving per request is measurable at 64
    # streams on two cores, and the bodies are the engines' to validate anyway.
    for route in ("/v1/completions", "/v1/chat/completions"):
        app.add_route(route, endpoint(route, generate), methods=["POST"])
    for route in ("/tokenize", "/detokenize"):
        app.add_route(route, endpoint(route, router.forward_any), methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(router.models())

    @app.get("/health")
    async def health() -> Response:
        """200 once every known engine has been checked; the router itself is up."""
        if not router.ready():
            return APIError(503, "the router is starting: engines not checked yet").response()
        available = sum(1 for e in router.describe() if e["available"])
        return _json({"status": "ok", "engines": len(router.engines), "available": available})

    @app.get("/engines")
    async def engines() -> Response:
        return _json({"engines": router.describe(), "models": router.describe_models()})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(HTTPMetrics, registry=metrics.registry)
    app.add_middleware(RequestTracing, tracer=router.tracer, forward_id=True)
    return app
