"""The HTTP server lifecycle that the engine's API server and the router share.

Both run one ASGI app under uvicorn with the same listen settings (`ListenConfig`), the same
deadline for reading each request (`_ReadTimeoutProtocol`, which also closes idle TLS
connections without waiting for the client's close_notify, so that none holds a stop), signals
handled by their own code rather than uvicorn's (`HTTPServer.handle_signals`), the same answer
to a client that leaves before its answer is ready (`cancel_on_disconnect`) and the same process
runner (`run`).

Why the read deadline: uvicorn times out only idle keep-alive connections. A client that
connects and sends nothing, or sends its headers or body a byte at a time and then stalls (slow
loris), holds its connection and its socket forever. Here every request must arrive whole
(request line, headers and body) within `read_timeout` seconds of its first byte (or of the
connection, for the first request); past that the connection is closed, and a request already
handed to the app sees a disconnect.

Their protocol also offers a streamed response a way past the ASGI `send` chain for its body
(`BODY_WRITER` in the scope's extensions, as ASGI servers offer theirs): a chunk written with it
goes straight onto the connection, framed as uvicorn frames it. The router and the engine's
event streams send each token's chunk that way, which at 64 streams on one core is what a
chunk costs (docs/router.md); the middlewares read only a response's start, which still goes
through `send`.

Both also share who may call them (`BearerAuth`, on with `--api-key` or `BATON_API_KEY`, as
vLLM's `--api-key` / `VLLM_API_KEY`) and TLS (`--ssl-certfile` / `--ssl-keyfile`, uvicorn's).
With a key every path but the liveness and metrics ones (`OPEN_PATHS`) needs
`Authorization: Bearer <key>`: vLLM guards only `/v1/*`, which leaves `/tokenize` (templates
rendered, prompts tokenized: work any caller could order) open; here it is not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import hashlib
import os
import secrets
import signal
import ssl
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import prometheus_client
import uvicorn
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from baton.errors import APIError

T = TypeVar("T")

DEFAULT_READ_TIMEOUT = 30.0  # seconds; nginx gives 60 to headers and 60 between body reads
# What a client that left before its answer is logged with (nginx's code); nobody reads it.
CLIENT_CLOSED = 499
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
API_KEY_ENV = "BATON_API_KEY"  # the key when --api-key is not given (vLLM: VLLM_API_KEY)
# What a client may call without the key: probes and scrapers hold no key.
OPEN_PATHS = frozenset(("/health", "/metrics"))
# The scope extension holding a request's `write_body(chunk) -> bool` (see `body_writer`).
BODY_WRITER = "baton.write_body"


@dataclass(frozen=True)
class ListenConfig:
    """Where an HTTP server listens, how long it waits for requests and at shutdown, and how
    uvicorn logs."""

    host: str = "0.0.0.0"
    port: int = 8000
    shutdown_timeout: float = 30.0  # seconds open requests get after SIGTERM
    request_read_timeout: float = DEFAULT_READ_TIMEOUT  # seconds a client has to send a request
    access_log: bool = False
    uvicorn_log_level: str = "warning"
    # Any one of these as `Authorization: Bearer <key>` opens every path but OPEN_PATHS;
    # empty: no check. Kept out of repr so that a logged config does not log the keys.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    ssl_certfile: str | None = None  # PEM certificate (chain): serve HTTPS
    ssl_keyfile: str | None = None  # its private key (default: in ssl_certfile)
    ssl_ca_certs: str | None = None  # CAs that client certificates are verified against
    ssl_cert_reqs: int = int(ssl.CERT_NONE)  # 2 (CERT_REQUIRED): clients must show a cert

    def __post_init__(self) -> None:
        if any(not key for key in self.api_keys):
            raise ValueError("api_keys must not contain an empty key")
        if self.ssl_certfile is None and (
            self.ssl_keyfile or self.ssl_ca_certs or self.ssl_cert_reqs != ssl.CERT_NONE
        ):
            raise ValueError("ssl_keyfile, ssl_ca_certs and ssl_cert_reqs need ssl_certfile")
        if self.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ValueError(f"ssl_cert_reqs must be 0, 1 or 2, got {self.ssl_cert_reqs}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.request_read_timeout <= 0:
            raise ValueError(f"request_read_timeout must be > 0, got {self.request_read_timeout}")


def add_listen_args(parser: argparse.ArgumentParser, defaults: type[ListenConfig]) -> None:
    """The flags both servers take for where they listen and how long a request may take to
    arrive, with `defaults`' values."""
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument(
        "--request-read-timeout",
        type=float,
        default=defaults.request_read_timeout,
        help="seconds a client has to send a whole request (headers and body); slower "
        "connections are closed",
    )
    parser.add_argument(
        "--api-key",
        dest="api_keys",
        nargs="+",
        default=None,
        metavar="KEY",
        help=f"require `Authorization: Bearer KEY` (any of the keys given) on every path but "
        f"{', '.join(sorted(OPEN_PATHS))} (default: ${API_KEY_ENV}, which keeps the key off "
        f"the command line)",
    )
    parser.add_argument("--ssl-certfile", default=None, help="PEM certificate: serve HTTPS")
    parser.add_argument("--ssl-keyfile", default=None, help="the certificate's private key")
    parser.add_argument(
        "--ssl-ca-certs", default=None, help="CA bundle that client certificates are checked with"
    )
    parser.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=defaults.ssl_cert_reqs,
        help="client certificates: 0 not asked, 1 checked if sent, 2 required (Python ssl's)",
    )


def api_keys_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The keys of `--api-key`, else the one in $BATON_API_KEY (none when it is unset or
    empty)."""
    if args.api_keys:
        return tuple(args.api_keys)
    key = os.environ.get(API_KEY_ENV, "")
    return (key,) if key else ()


# ---- the read deadline -----------------------------------------------------------------------


class _ReadTimeoutProtocol(HttpToolsProtocol):
    read_timeout = DEFAULT_READ_TIMEOUT

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._read_deadline is None:
            self._read_deadline = self.loop.call_later(self.read_timeout, self._on_read_timeout)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _on_read_timeout(self) -> None:
        self._read_deadline = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection whose request took over %.0f s to arrive",
                             self.read_timeout)  # fmt: skip
            self._close()  # then connection_lost: a request in the app sees a disconnect

    def _close(self) -> None:
        """Closes an idle or stalled connection. Over TLS, after sending close_notify, without
        waiting for the client's: the event loop would wait up to 30 s for it, and a pooled
        client that is not reading its socket never sends it, so the connection would hold a
        stop that long. The side that closes need not wait (RFC 8446, 6.1)."""
        self.transport.close()
        if self.transport.get_extra_info("ssl_object") is not None:
            self.transport.abort()

    def shutdown(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self._close()
        else:
            self.cycle.keep_alive = False  # uvicorn's: closed once its response is sent

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing():
            self._close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # not an upgrade: a new request
            extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
            extensions[BODY_WRITER] = functools.partial(_write_body, cycle)


def protocol_class(read_timeout: float = DEFAULT_READ_TIMEOUT) -> type[HttpToolsProtocol]:
    """The protocol class to give uvicorn (`http=`): httptools' with the read deadline and
    `BODY_WRITER`."""
    return type("ReadTimeoutProtocol", (_ReadTimeoutProtocol,), {"read_timeout": read_timeout})


def _write_body(cycle: RequestResponseCycle, chunk: bytes) -> bool:
    """`chunk` written at once as the next piece of `cycle`'s chunked response body; False,
    with nothing written, where it must go through `send` instead: before the response's
    start or after its end, a body not chunked, a connection whose writes are paused (`send`
    waits for the client to drain it) or gone."""
    if (
        not cycle.response_started
        or cycle.response_complete
        or not cycle.chunked_encoding
        or cycle.flow.write_paused
        or cycle.disconnected
        or cycle.transport.is_closing()
    ):
        return False
    if chunk:  # an empty chunk would end the body
        cycle.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    return True


def body_writer(scope: Scope) -> Callable[[bytes], bool] | None:
    """The server's `write_body` for this request, None under a server without one (tests'
    in-process transports): a streamed response calls it with each body chunk once its
    start is sent, and sends the chunk through `send` where it returns False."""
    extensions = scope.get("extensions")
    return extensions.get(BODY_WRITER) if extensions else None


# ---- who may call -----------------------------------------------------------------------------


class BearerAuth:
    """Answers 401 (OpenAI's error shape) to a request outside OPEN_PATHS that does not carry
    one of `keys` as `Authorization: Bearer <key>`, before the app or its body is read.

    Keys are compared as SHA-256 digests with `secrets.compare_digest`, every key every time:
    how long a check takes says nothing of how much of a guess was right, or of which key
    nearly matched.
    """

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        if not keys:
            raise ValueError("BearerAuth needs at least one key")
        self.app = app
        self._digests = tuple(hashlib.sha256(key.encode()).digest() for key in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _is_open(scope):
            await self.app(scope, receive, send)
            return
        error = self._refusal(scope)
        if error is None:
            await self.app(scope, receive, send)
            return
        response = error.response()
        response.headers["www-authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        """None when the request carries a key; else the 401 that says what is wrong."""
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if header is None:
            return APIError(401, "no API key given: send `Authorization: Bearer <key>`")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return APIError(401, "the Authorization header must be `Bearer <key>`")
        digest = hashlib.sha256(token).digest()
        match = False
        for known in self._digests:
            match |= secrets.compare_digest(digest, known)
        return None if match else APIError(401, "incorrect API key")


def _is_open(scope: Scope) -> bool:
    # The path as routing sees it: without the mount's root_path, and without a trailing
    # slash, so that a probe of `/health/` is not refused for the slash.
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return (path.rstrip("/") or "/") in OPEN_PATHS


# ---- serving ---------------------------------------------------------------------------------


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling, which re-raises the signal at exit (a clean
    SIGTERM stop would end with -15) and knows nothing of the engine's drain."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HTTPServer:
    """One ASGI app under uvicorn, on `ListenConfig`'s address, with the read deadline, the
    API key check (outermost, so that no unauthenticated body is buffered) and TLS when
    configured.

    The owner decides what SIGINT and SIGTERM mean (`handle_signals`) and ends serving with
    `stop`; uvicorn then closes the listener, gives open requests `graceful_shutdown` seconds
    and returns from `serve`.
    """

    def __init__(
        self,
        app: ASGIApp,
        listen: ListenConfig,
        *,
        lifespan: Literal["on", "off"],
        graceful_shutdown: float,
    ) -> None:
        if listen.api_keys:
            app = BearerAuth(app, listen.api_keys)
        config = uvicorn.Config(
            app,
            host=listen.host,
            port=listen.port,
            http=protocol_class(listen.request_read_timeout),
            lifespan=lifespan,
            access_log=listen.access_log,
            log_config=None,  # uvicorn's lines go through the process's handler (baton.logs)
            log_level=listen.uvicorn_log_level,
            timeout_graceful_shutdown=int(graceful_shutdown),
            ssl_certfile=listen.ssl_certfile,
            ssl_keyfile=listen.ssl_keyfile,
            ssl_ca_certs=listen.ssl_ca_certs,
            ssl_cert_reqs=listen.ssl_cert_reqs,
        )
        self._uvicorn = _Uvicorn(config)

    @property
    def started(self) -> bool:
        """Whether it got as far as listening (False when the lifespan start-up failed)."""
        return bool(self._uvicorn.started)

    @property
    def stopping(self) -> bool:
        return bool(self._uvicorn.should_exit)

    async def serve(self) -> None:
        """Serves until `stop`. When it cannot bind, uvicorn raises SystemExit (code 3); when
        the app's lifespan start-up fails, it returns at once with `started` False."""
        await self._uvicorn.serve()

    def stop(self, *, force: bool = False) -> None:
        """Ends serving: gracefully, or (`force`) cutting open requests at once."""
        self._uvicorn.should_exit = True
        if force:
            self._uvicorn.force_exit = True

    @staticmethod
    @contextlib.contextmanager
    def handle_signals(on_signal: Callable[[signal.Signals], None]) -> Iterator[None]:
        """Calls `on_signal` on SIGINT and SIGTERM in the running loop, inside the block."""
        loop = asyncio.get_running_loop()
        for sig in _SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            yield
        finally:
            for sig in _SIGNALS:
                loop.remove_signal_handler(sig)


def freeze_startup_heap() -> None:
    """Puts what a server's start-up made (its app, a tokenizer, the engine's client: all of it
    lives as long as the process) out of the garbage collector's reach, so that a full pass
    walks only what requests made since; vLLM's API server does the same. In the router such a
    pass took up to 43 ms, which every open stream waited out (docs/benchmarks.md). Only for a
    server process's main: a frozen object is never collected."""
    gc.collect()
    gc.freeze()


def run(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Runs a server's `main` to the end on uvloop where it is installed; its exit code."""
    # vLLM's expositions have no `_created` series; a process-wide switch, so only here.
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())


# ---- clients that leave ----------------------------------------------------------------------


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it if the client disconnects first (then raises ClientGone).

    The cancelled work is awaited before ClientGone is raised, so its cleanup (an engine
    aborting its requests) has run by the time the handler answers.
    """
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        gone = not task.done()
        if gone:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if gone:
        raise ClientGone()
    return task.result()
