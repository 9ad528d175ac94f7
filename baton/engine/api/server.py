"""The OpenAI-compatible engine server: a FastAPI app over one `AsyncLLM`, and its lifecycle.

`build_app` makes the app (routes, error shapes, body limit, metrics) around an `EngineServer`
(`serving`), which handles the requests. `run_server` starts the EngineCore, serves until
SIGTERM (drain: new requests get 503, in-flight ones finish and a prefill engine's leased KV
blocks are claimed or expire, within `shutdown_timeout`; exit 0)
or until the core dies (every open request fails with 503 at once, exit 1, so Kubernetes
restarts the pod).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from baton.engine.api import protocol as p
from baton.engine.api import responses as r
from baton.engine.api.metrics import CONTENT_TYPE
from baton.engine.api.serving import EngineServer
from baton.engine.api.streams import cancel_on_disconnect
from baton.engine.async_llm import AsyncLLM
from baton.engine.config import EXECUTOR_BACKENDS, EngineArgs
from baton.http_timeouts import DEFAULT_READ_TIMEOUT, read_timeout_protocol
from baton.kv_transfer.base import FAILURE_POLICIES, ROLES, TRANSPORTS, KVTransferConfig

logger = logging.getLogger(__name__)

_DEAD_FLUSH_SECONDS = 2.0  # after the core died: time for open requests to send their errors
_LEASE_POLL_SECONDS = 0.05  # how often the drain looks whether the leases have ended


@dataclass(frozen=True)
class ServerConfig:
    """How the API server listens and admits requests (the engine has its own `EngineArgs`)."""

    host: str = "0.0.0.0"
    port: int = 8000
    served_model_name: str | None = None  # None: the model folder's name
    max_waiting_requests: int | None = None  # 429 once the engine has this many waiting
    max_body_bytes: int = 10 << 20  # 413 past this
    shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    request_read_timeout: float = DEFAULT_READ_TIMEOUT  # seconds a client has to send a request
    engine_label: str = "0"  # the `engine` label of every metric
    uvicorn_log_level: str = "info"
    access_log: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.request_read_timeout <= 0:
            raise ValueError(f"request_read_timeout must be > 0, got {self.request_read_timeout}")


# ---- the app -------------------------------------------------------------------------------


def _error(error: p.APIError) -> JSONResponse:
    return JSONResponse(error.response().model_dump(mode="json"), status_code=error.status)


class _BodyLimit:
    """Answers 413 to a body over `max_bytes`, by its Content-Length or by what arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_large = p.APIError(413, f"the request body is larger than {self.max_bytes} bytes")
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await _error(p.APIError(400, "invalid Content-Length"))(scope, receive, send)
                return
            if int(length) > self.max_bytes:
                await _error(too_large)(scope, receive, send)
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
                await _error(too_large)(scope, receive, send)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def build_app(llm: AsyncLLM, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `llm`; `app.state.server` is its `EngineServer`."""
    server = EngineServer(
        llm,
        served_model_name=config.served_model_name,
        max_waiting_requests=config.max_waiting_requests,
        engine_label=config.engine_label,
    )
    app = FastAPI(title="Baton engine", description="OpenAI-compatible API (vLLM's shapes)")
    app.state.server = server

    @app.exception_handler(p.APIError)
    async def api_error(_: Request, exc: p.APIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(_from_validation(exc))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return _error(p.APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return _error(p.APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    errors: dict[int | str, dict[str, Any]] = {
        code: {"model": p.ErrorResponse} for code in (400, 404, 413, 429, 503)
    }

    @app.get("/health", responses={503: {"model": p.ErrorResponse}})
    async def health() -> Response:
        """200 with the engine's role and KV transport while it serves; 503 when draining or
        the engine died."""
        if not server.healthy():
            return _error(p.APIError(503, "draining" if server.draining else "the engine is dead"))
        return JSONResponse(server.health())

    @app.get("/v1/models", response_model=r.ModelList)
    async def models() -> r.ModelList:
        return server.models()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize", response_model=r.TokenizeResponse, responses=errors)
    async def tokenize(req: p.TokenizeRequest) -> r.TokenizeResponse:
        return server.tokenize(req)

    @app.post("/detokenize", response_model=r.DetokenizeResponse, responses=errors)
    async def detokenize(req: p.DetokenizeRequest) -> r.DetokenizeResponse:
        return server.detokenize(req)

    @app.post("/v1/completions", responses={200: {"model": r.CompletionResponse}, **errors})
    async def completions(req: p.CompletionRequest, raw: Request) -> Response:
        return await cancel_on_disconnect(raw, server.completions(req))

    @app.post(
        "/v1/chat/completions", responses={200: {"model": r.ChatCompletionResponse}, **errors}
    )
    async def chat_completions(req: p.ChatCompletionRequest, raw: Request) -> Response:
        return await cancel_on_disconnect(raw, server.chat_completions(req))

    app.add_middleware(_BodyLimit, max_bytes=config.max_body_bytes)
    return app


def _from_validation(exc: RequestValidationError) -> p.APIError:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return p.APIError(
                400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}"
            )
        field = ".".join(loc)
        param = param or (loc[0] if loc else None)
        parts.append(f"{field}: {err.get('msg')}" if field else str(err.get("msg")))
    return p.APIError(400, "; ".join(parts) or "invalid request", param)


# ---- lifecycle -----------------------------------------------------------------------------


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: `run_server` owns SIGTERM (the drain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def run_server(engine_args: EngineArgs, config: ServerConfig) -> int:
    """Starts the engine, serves until SIGTERM or the engine's death; returns the exit code.

    SIGTERM (or SIGINT): stop admitting (503), let in-flight requests finish, then let leased
    KV blocks be claimed or expire (a decode engine may still pull them), all within
    `shutdown_timeout`; exit 0. A second signal exits at once. The core's death: every open
    request has already failed with 503; give them a moment to flush, exit 1.
    """
    # vLLM's exposition has no `_created` series; this is a process-wide prometheus switch.
    prometheus_client.disable_created_metrics()
    llm = await AsyncLLM.start(engine_args)
    app = build_app(llm, config)
    server: EngineServer = app.state.server
    uv = _Uvicorn(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            http=read_timeout_protocol(config.request_read_timeout),  # slow clients dropped
            log_level=config.uvicorn_log_level,
            access_log=config.access_log,
            lifespan="off",
            timeout_graceful_shutdown=2,  # the drain happened already, see below
        )
    )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if server.draining:  # a second signal: no more patience
            uv.force_exit = uv.should_exit = True
            return
        logger.info("%s: draining %d in-flight requests", sig.name, server.num_in_flight)
        server.draining = True
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    llm.add_dead_callback(lambda _: stop.set())
    serving = asyncio.create_task(uv.serve())
    stopped = asyncio.create_task(stop.wait())
    exit_code = 0
    try:
        await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if serving.done():  # uvicorn could not start (port taken, ...)
            serving.result()
            return 1
        if llm.dead_error is not None:
            exit_code = 1
            await server.wait_idle(_DEAD_FLUSH_SECONDS)
        else:
            deadline = loop.time() + config.shutdown_timeout
            if not await server.wait_idle(config.shutdown_timeout):
                logger.warning(
                    "shutdown timeout (%.0f s): cutting %d requests",
                    config.shutdown_timeout,
                    server.num_in_flight,
                )
            elif not await _wait_leases(llm, deadline - loop.time()):
                logger.warning(
                    "shutdown timeout: dropping %d leased KV blocks", llm.stats.kv_blocks_leased
                )
        uv.should_exit = True
        await serving
    finally:
        stopped.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        try:
            await asyncio.wait_for(llm.shutdown(), 10)
        except Exception:
            logger.exception("engine shutdown failed")
    logger.info("server stopped (exit code %d)", exit_code)
    return exit_code


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


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The engine server's flags, under vLLM's names."""
    e, s = EngineArgs, ServerConfig
    parser.add_argument("--model", default=None, help="model folder (default: the built-in model)")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--host", default=s.host)
    parser.add_argument("--port", type=int, default=s.port)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-model-len", type=int, default=e.max_model_len)
    parser.add_argument("--block-size", type=int, default=e.block_size)
    parser.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=e.max_num_batched_tokens)
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=e.enable_prefix_caching,
    )
    parser.add_argument("--dtype", default=e.dtype)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=e.num_gpu_blocks_override)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=e.kv_cache_memory_bytes)
    parser.add_argument("--gpu-memory-utilization", type=float, default=e.gpu_memory_utilization)
    parser.add_argument("--seed", type=int, default=e.seed)
    parser.add_argument("--scheduling-policy", default=e.scheduling_policy)
    parser.add_argument("--device", default=e.device)
    parser.add_argument("--attention-backend", default=e.attention_backend)
    parser.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=e.async_scheduling
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=e.tensor_parallel_size,
        help="worker processes, one per rank (one per GPU), that split the model's heads",
    )
    parser.add_argument(
        "--distributed-executor-backend",
        choices=EXECUTOR_BACKENDS,
        default=e.distributed_executor_backend,
        help="uni: the model in the engine core process; mp: worker processes (default: uni "
        "for --tensor-parallel-size 1, mp above)",
    )
    parser.add_argument("--max-waiting-requests", type=int, default=s.max_waiting_requests)
    parser.add_argument("--max-body-bytes", type=int, default=s.max_body_bytes)
    parser.add_argument("--shutdown-timeout", type=float, default=s.shutdown_timeout)
    parser.add_argument(
        "--request-read-timeout",
        type=float,
        default=s.request_read_timeout,
        help="seconds a client has to send a whole request (headers and body); slower "
        "connections are closed",
    )
    parser.add_argument("--uvicorn-log-level", default=s.uvicorn_log_level)
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    k = KVTransferConfig
    parser.add_argument(
        "--role",
        choices=ROLES,
        default="both",
        help="prefill: answers do_remote_decode requests and leases their KV; decode: pulls "
        "KV for do_remote_prefill requests; both: serves alone (with --kv-transport, both)",
    )
    parser.add_argument(
        "--kv-transport",
        choices=TRANSPORTS,
        default=None,
        help="how KV blocks move between engines (default tcp for prefill/decode roles; nixl "
        "falls back to tcp, with a warning, when the nixl package cannot be imported)",
    )
    parser.add_argument("--kv-host", default=None, help="KV server bind address (default --host)")
    parser.add_argument("--kv-port", type=int, default=k.port, help="KV server port (0: free)")
    parser.add_argument(
        "--kv-advertise-host",
        default=None,
        help="address decode engines reach this engine's KV server at (default: --kv-host, or "
        "127.0.0.1 when that is 0.0.0.0)",
    )
    parser.add_argument("--kv-lease-seconds", type=float, default=k.lease_seconds)
    parser.add_argument("--kv-load-timeout", type=float, default=k.load_timeout)
    parser.add_argument(
        "--kv-load-failure-policy", choices=FAILURE_POLICIES, default=k.load_failure_policy
    )


def configs_from_args(args: argparse.Namespace) -> tuple[EngineArgs, ServerConfig]:
    """`EngineArgs` and `ServerConfig` from `add_server_args`' flags; ValueError if invalid."""
    engine = EngineArgs(
        model=args.model,
        tokenizer=args.tokenizer,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        dtype=args.dtype,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
        scheduling_policy=args.scheduling_policy,
        device=args.device,
        attention_backend=args.attention_backend,
        async_scheduling=args.async_scheduling,
        kv_transfer=_kv_transfer_config(args),
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
    )
    server = ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_waiting_requests=args.max_waiting_requests,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        request_read_timeout=args.request_read_timeout,
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
    )
    return engine, server


def _kv_transfer_config(args: argparse.Namespace) -> KVTransferConfig | None:
    """The KV connector's config; None for an aggregated engine that asked for no transport."""
    if args.role == "both" and args.kv_transport is None:
        return None
    host = args.kv_host or args.host
    advertise = args.kv_advertise_host or ("127.0.0.1" if host in ("0.0.0.0", "::") else host)
    return KVTransferConfig(
        role=args.role,
        transport=args.kv_transport or "tcp",
        host=host,
        port=args.kv_port,
        advertise_host=advertise,
        lease_seconds=args.kv_lease_seconds,
        load_timeout=args.kv_load_timeout,
        load_failure_policy=args.kv_load_failure_policy,
    )


def serve(engine_args: EngineArgs, config: ServerConfig) -> int:
    """Runs the server to the end on uvloop where it is installed; returns the exit code."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run_server(engine_args, config))
    return uvloop.run(run_server(engine_args, config))


def add_args(parser: argparse.ArgumentParser) -> None:
    """`baton engine`'s flags."""
    add_server_args(parser)


def run(args: argparse.Namespace) -> int:
    """`baton engine`: serve until stopped; the exit code says how it ended."""
    return serve(*configs_from_args(args))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="baton engine", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    add_server_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        engine_args, server_config = configs_from_args(args)
        code = serve(engine_args, server_config)
    except (ValueError, FileNotFoundError) as e:
        print(f"baton engine: error: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
