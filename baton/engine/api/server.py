"""The OpenAI-compatible engine server: a FastAPI app over one `AsyncLLM`, and its lifecycle.

`build_app` makes the app (routes, error shapes, body limit, metrics) around an `EngineServer`
(`serving`), which handles the requests. `run_server` starts the EngineCore, serves until
SIGTERM (drain: new requests get 503, in-flight ones finish and a prefill engine's leased KV
blocks are claimed or expire, within `shutdown_timeout`; what is still in flight then fails with
503, a stream with an error event the router resumes elsewhere; exit 0) or until the core dies
(every open request fails with 503 at once, exit 1, so Kubernetes restarts the pod). Its flags
are `cli`'s; uvicorn, the read deadline and signals are `baton.http_server`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from baton.engine.api import protocol as p
from baton.engine.api import responses as r
from baton.engine.api.metrics import CONTENT_TYPE
from baton.engine.api.reasoning import reasoning_parser
from baton.engine.api.serving import EngineServer
from baton.engine.api.tool_parsers import tool_parser
from baton.engine.api.tools import ToolConfig
from baton.engine.async_llm import AsyncLLM
from baton.engine.config import EngineArgs
from baton.engine.generation_config import check_source, sampling_defaults
from baton.errors import APIError
from baton.http_metrics import HTTPMetrics
from baton.http_server import (
    CLIENT_CLOSED,
    ClientGone,
    HTTPServer,
    ListenConfig,
    cancel_on_disconnect,
    freeze_startup_heap,
    run,
)
from baton.tracing import NO_NATIVE_TELEMETRY, RequestTracing, check_endpoint
from baton.version import __version__

logger = logging.getLogger(__name__)

_DEAD_FLUSH_SECONDS = 2.0  # after the core died: time for open requests to send their errors
_CUT_FLUSH_SECONDS = 2.0  # at the drain timeout: the same, for the requests it fails
_CUT_POLL_SECONDS = 0.05  # how often those are failed again (a late one opens its stream later)
# What a request in flight at the drain timeout ends with, as a 503: a stream as an error event
# and `data: [DONE]` (the router resumes it on another engine), any other as the answer.
DRAIN_TIMEOUT_MESSAGE = "the engine is shutting down (drain timeout)"
_LEASE_POLL_SECONDS = 0.05  # how often the drain looks whether the leases have ended


@dataclass(frozen=True)
class ServerConfig(ListenConfig):
    """How the API server listens (`ListenConfig`, with the engine's louder logging) and
    admits requests (the engine has its own `EngineArgs`)."""

    served_model_name: str | None = None  # None: the model folder's name
    max_waiting_requests: int | None = None  # 429 once the engine has this many waiting
    max_body_bytes: int = 10 << 20  # 413 past this
    engine_label: str = "0"  # the `engine` label of every metric
    trust_request_chat_template: bool = False  # render a request's own chat_template (vLLM's)
    # usage.prompt_tokens_details.cached_tokens (vLLM's flag, off by default there; on here, as
    # OpenAI always sends it)
    enable_prompt_tokens_details: bool = True
    disable_log_stats: bool = False  # no per-request metrics (vLLM's flag); gauges still scrape
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (with tool_call_parser)
    tool_call_parser: str | None = None  # a name in tool_parsers.TOOL_PARSERS
    reasoning_parser: str | None = None  # a name in reasoning.REASONING_PARSERS
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector for spans (vLLM's flag)
    # Where requests' sampling defaults come from (vLLM's flags): "auto" the model folder's
    # generation_config.json, "vllm" none, or a folder's; the override's fields on top.
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    access_log: bool = True
    uvicorn_log_level: str = "info"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        self.tool_config()  # an unknown parser name stops the start, naming the known ones
        check_endpoint(self.otlp_traces_endpoint)
        check_source(self.generation_config)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    def tool_config(self) -> ToolConfig:
        return ToolConfig(
            enable_auto_tool_choice=self.enable_auto_tool_choice,
            tool_parser=None
            if self.tool_call_parser is None
            else tool_parser(self.tool_call_parser),
            reasoning_parser=(
                None if self.reasoning_parser is None else reasoning_parser(self.reasoning_parser)
            ),
        )


# ---- the app -------------------------------------------------------------------------------


class _BodyLimit:
    """Answers 413 to a body over `max_bytes`, by its Content-Length or by what arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_large = APIError(413, f"the request body is larger than {self.max_bytes} bytes")
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await APIError(400, "invalid Content-Length").response()(scope, receive, send)
                return
            if int(length) > self.max_bytes:
                await too_large.response()(scope, receive, send)
                return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                await too_large.response()(scope, receive, send)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _sampling_defaults(llm: AsyncLLM, config: ServerConfig) -> dict[str, Any]:
    """The model's recommended sampling defaults, said in the log as vLLM says them."""
    defaults = sampling_defaults(
        llm.model_path, config.generation_config, config.override_generation_config
    )
    if defaults and config.generation_config != "vllm":
        logger.warning(
            "Default sampling parameters have been overridden by %s: %s. If this is not "
            "intended, start the server with `--generation-config vllm`.",
            "the model's generation_config.json"
            if config.generation_config == "auto"
            else config.generation_config,
            defaults,
        )
    return defaults


def build_app(llm: AsyncLLM, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `llm`; `app.state.server` is its `EngineServer`."""
    server = EngineServer(
        llm,
        served_model_name=config.served_model_name,
        max_waiting_requests=config.max_waiting_requests,
        engine_label=config.engine_label,
        trust_request_chat_template=config.trust_request_chat_template,
        prompt_tokens_details=config.enable_prompt_tokens_details,
        tool_config=config.tool_config(),
        log_stats=not config.disable_log_stats,
        otlp_traces_endpoint=config.otlp_traces_endpoint,
        sampling_defaults=_sampling_defaults(llm, config),
    )
    app = FastAPI(
        title="Baton engine",
        description="OpenAI-compatible API (vLLM's shapes)",
        telemetry=NO_NATIVE_TELEMETRY,
    )
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        return _from_validation(exc).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED)  # its engine requests were aborted

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> Response:
        logger.exception("request failed")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    errors: dict[int | str, dict[str, Any]] = {
        code: {"model": p.ErrorResponse} for code in (400, 404, 413, 429, 503)
    }

    @app.get("/health", responses={503: {"model": p.ErrorResponse}})
    async def health() -> Response:
        """200 with the engine's role and KV transport while it serves; 503 when draining or
        the engine died."""
        if not server.healthy():
            return APIError(503, "draining" if server.draining else "the engine is dead").response()
        return JSONResponse(server.health())

    @app.get("/baton/tokenizer")
    async def tokenizer() -> Response:
        """The tokenizer this engine tokenizes with (tokenizer.json, named special tokens, chat
        templates): the router's copy, so that its block hashes are this engine's."""
        return JSONResponse(server.tokenizer.to_wire())

    @app.get("/version")
    async def version() -> Response:
        """This server's version, as vLLM's `/version` gives its own."""
        return JSONResponse({"version": __version__})

    @app.get("/v1/models", response_model=r.ModelList)
    async def models() -> r.ModelList:
        return server.models()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize", response_model=r.TokenizeResponse, responses=errors)
    async def tokenize(req: p.TokenizeRequest) -> r.TokenizeResponse:
        return await server.tokenize(req)

    @app.post("/detokenize", response_model=r.DetokenizeResponse, responses=errors)
    async def detokenize(req: p.DetokenizeRequest) -> r.DetokenizeResponse:
        return server.detokenize(req)

    @app.post("/v1/completions", responses={200: {"model": r.CompletionResponse}, **errors})
    async def completions(req: p.CompletionRequest, raw: Request) -> Response:
        return await cancel_on_disconnect(raw, server.completions(req, _request_id(raw)))

    @app.post(
        "/v1/chat/completions", responses={200: {"model": r.ChatCompletionResponse}, **errors}
    )
    async def chat_completions(req: p.ChatCompletionRequest, raw: Request) -> Response:
        return await cancel_on_disconnect(raw, server.chat_completions(req, _request_id(raw)))

    app.add_middleware(_BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(HTTPMetrics, registry=server.metrics.registry)
    app.add_middleware(RequestTracing, tracer=server.tracer)
    return app


def _request_id(raw: Request) -> str | None:
    """The X-Request-Id header, which names the response (before a body's request_id, as in
    vLLM); never an engine request (`serving` makes those unique)."""
    return raw.headers.get("x-request-id") or None


def _from_validation(exc: RequestValidationError) -> APIError:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return APIError(
                400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}"
            )
        field = ".".join(loc)
        param = param or (loc[0] if loc else None)
        parts.append(f"{field}: {err.get('msg')}" if field else str(err.get("msg")))
    return APIError(400, "; ".join(parts) or "invalid request", param)


# ---- lifecycle -----------------------------------------------------------------------------


async def run_server(engine_args: EngineArgs, config: ServerConfig) -> int:
    """Starts the engine, serves until SIGTERM or the engine's death; returns the exit code.

    SIGTERM (or SIGINT): stop admitting (503), let in-flight requests finish, then let leased
    KV blocks be claimed or expire (a decode engine may still pull them), all within
    `shutdown_timeout`; requests still in flight then fail with 503 (`DRAIN_TIMEOUT_MESSAGE`)
    rather than a cut connection; exit 0. A second signal exits at once, cutting what is open. The
    core's death: every open request has already failed with 503; give them a moment to flush,
    exit 1.
    """
    llm = await AsyncLLM.start(engine_args)
    app = build_app(llm, config)
    server: EngineServer = app.state.server
    # uvicorn's own graceful shutdown is short: the drain below happened already.
    http = HTTPServer(app, config, lifespan="off", graceful_shutdown=2)
    freeze_startup_heap()
    stop = asyncio.Event()
    draining: asyncio.Task[None] | None = None

    def on_signal(sig: signal.Signals) -> None:
        if server.draining:  # a second signal: no more patience, not even for leases
            if draining is not None:
                draining.cancel()
            http.stop(force=True)
            return
        logger.info("%s: draining %d in-flight requests", sig.name, server.num_in_flight)
        server.draining = True
        stop.set()

    llm.add_dead_callback(lambda _: stop.set())
    serving = asyncio.create_task(http.serve())
    stopped = asyncio.create_task(stop.wait())
    exit_code = 0
    try:
        with http.handle_signals(on_signal):
            await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if serving.done():  # uvicorn ended on its own: it could not start
                serving.result()
                return 1
            if llm.dead_error is not None:
                exit_code = 1
                await server.wait_idle(_DEAD_FLUSH_SECONDS)
            else:
                draining = asyncio.create_task(_drain(llm, server, config.shutdown_timeout))
                with contextlib.suppress(asyncio.CancelledError):
                    await draining
            http.stop()
            await serving
    finally:
        stopped.cancel()
        await asyncio.to_thread(server.tracer.shutdown)  # the spans still queued
        try:
            await asyncio.wait_for(llm.shutdown(), 10)
        except Exception:
            logger.exception("engine shutdown failed")
    logger.info("server stopped (exit code %d)", exit_code)
    return exit_code


async def _drain(llm: AsyncLLM, server: EngineServer, timeout: float) -> None:
    """Lets in-flight requests finish, then leased KV blocks be claimed, within `timeout`.

    At the timeout, the requests still in flight fail with a 503: a stream ends with it as an
    error event and `[DONE]`, which the router takes as its cue to resume the stream on another
    engine; any other request gets the 503 as its answer. Their engine requests are aborted
    (their KV blocks freed), as for clients that leave.
    """
    deadline = time.monotonic() + timeout
    if not await server.wait_idle(timeout):
        logger.warning(
            "shutdown timeout (%.0f s): failing %d requests with 503", timeout, server.num_in_flight
        )
        await _fail_in_flight(llm, server)
    elif not await _wait_leases(llm, deadline - time.monotonic()):
        logger.warning("shutdown timeout: dropping %d leased KV blocks", llm.stats.kv_blocks_leased)


async def _fail_in_flight(llm: AsyncLLM, server: EngineServer) -> None:
    """Fails every request in flight with a 503 (`DRAIN_TIMEOUT_MESSAGE`) and gives their answers
    `_CUT_FLUSH_SECONDS` to go out. A request admitted but still being prepared (tokenized,
    checked) opens its engine stream later: it is failed at a later poll."""
    error = APIError(503, DRAIN_TIMEOUT_MESSAGE)
    deadline = time.monotonic() + _CUT_FLUSH_SECONDS
    while True:
        llm.fail_all(error)
        if await server.wait_idle(_CUT_POLL_SECONDS) or time.monotonic() >= deadline:
            return


async def _wait_leases(llm: AsyncLLM, timeout: float) -> bool:
    """Waits until the engine holds no leased KV blocks (each claimed, released or expired);
    False if `timeout` passed first.

    Called once no request is in flight, so no new lease can start: the last one ends within
    the lease time. A decode engine pulls from the EngineCore's block server, not through the
    HTTP server, so the pulls go on while admission is closed.
    """
    kv = llm.args.kv_transfer
    if kv is None or llm.stats.kv_blocks_leased == 0:
        return True
    logger.info("waiting for %d leased KV blocks to be claimed", llm.stats.kv_blocks_leased)
    # The core frees an expired lease at its next 50 ms poll and then reports it.
    deadline = time.monotonic() + min(timeout, kv.lease_seconds + 1.0)
    while llm.stats.kv_blocks_leased and llm.dead_error is None:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_LEASE_POLL_SECONDS)
    return True


def serve(engine_args: EngineArgs, config: ServerConfig) -> int:
    """Runs the server to the end; returns the exit code."""
    return run(lambda: run_server(engine_args, config))
