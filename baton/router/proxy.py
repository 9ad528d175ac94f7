"""Sending one request to an engine, with retries on other engines before the first byte.

`Upstream.send` tries engines in the order a `pick` callback gives them. An attempt fails when
the connection fails, times out, or the engine answers 401/502/503/504 (or, streaming, breaks
before its first body bytes); the next engine is tried, up to `max_retries` more. A 429 is
backpressure, not failure: the next engine is tried and, if every engine tried answered 429,
so does the router. Any other answer (2xx, 4xx, 500) goes to the client as it is.

Once an answer's first bytes are in, the engine is committed: a stream is passed through chunk
by chunk as it arrives, never buffered (over `engine_stream`'s connections, from socket to
socket without a task per chunk; whole answers come over them too). A stream that breaks later
(its connection, an error event, no `data: [DONE]`) migrates to another engine when it can
(`migration`); otherwise it ends with an error event and `data: [DONE]` rather than a hang. A
whole answer reaches the client without the engine's `kv_transfer_params` (where an engine's KV
blocks wait is the router's business alone).

Every attempt carries the engines' key and TLS settings (`UpstreamAuth`), whatever headers
its caller passed: the client's `Authorization` never reaches an engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from baton.errors import APIError
from baton.http_server import body_writer
from baton.router.config import RouterConfig
from baton.router.engine_stream import EngineConnection, EngineStreams, StreamError
from baton.router.engines import EngineState
from baton.router.health import HealthMonitor
from baton.router.metrics import RouterMetrics
from baton.router.migration import Migrator, StreamLog, error_message
from baton.router.upstream_auth import UpstreamAuth

logger = logging.getLogger(__name__)

# An engine's 401 refuses the router's upstream key, not the client: a configuration fault of
# that engine, tried elsewhere (and ejected) like one that is down.
_RETRYABLE = frozenset((401, 502, 503, 504))
_DONE = b"data: [DONE]\n\n"

# Picks the next engine to try, given the URLs tried already; None when there is none left.
Pick = Callable[[set[str]], EngineState | None]


@dataclass
class Answer:
    """An engine's answer whose first bytes have arrived. Exactly one of `body` (whole) and
    `stream` (an event stream's connection, its first body bytes in) is set."""

    engine: EngineState
    status: int
    content_type: str
    body: bytes | None = None
    stream: EngineConnection | None = None


class _Failed(Exception):
    """An attempt that may be retried elsewhere."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class Upstream:
    """The router's side of every engine connection: sends, retries, streams, accounts."""

    def __init__(
        self,
        health: HealthMonitor,
        metrics: RouterMetrics,
        config: RouterConfig,
    ) -> None:
        self.health = health
        self.metrics = metrics
        self.max_retries = config.max_retries
        self.auth = UpstreamAuth(config)
        self.streams = EngineStreams(
            config.max_connections, config.connect_timeout, config.request_timeout, self.auth.ssl
        )

    async def send(
        self,
        route: str,
        pick: Pick,
        content: bytes,
        headers: Mapping[str, str],
        *,
        stream: bool,
        none_available: str,
    ) -> Answer:
        """The first usable answer from the engines `pick` offers; APIError if none gives
        one (503, or 429 when the engines tried all pushed back). `none_available` is the
        message when there is no engine to try at all."""
        tried: set[str] = set()
        failures = 0
        pushed_back: bytes | None = None
        last_failure = ""
        while failures <= self.max_retries:
            engine = pick(tried)
            if engine is None:
                break
            if tried:
                self.metrics.retry(route)
            tried.add(engine.url)
            engine.in_flight += 1
            answer: Answer | None = None
            try:
                answer = await self._attempt(engine, route, content, headers, stream)
            except _Failed as e:
                failures += 1
                last_failure = f"{engine.url}: {e.message}"
                logger.warning("request to %s%s failed: %s", engine.url, route, e.message)
                self.health.on_failure(engine, e.kind)
                continue
            finally:
                if answer is None or answer.stream is None:  # a stream's end releases it
                    engine.in_flight -= 1
            self.health.on_success(engine)
            if answer.status != 429:
                return answer
            pushed_back = answer.body
        if pushed_back is not None:
            message = error_message(pushed_back) or "every engine is over its queue bound"
            raise APIError(429, message)
        if not tried:
            raise APIError(503, none_available)
        raise APIError(
            503, f"no engine could take the request after {len(tried)} tries: {last_failure}"
        )

    async def _attempt(
        self,
        engine: EngineState,
        route: str,
        content: bytes,
        headers: Mapping[str, str],
        stream: bool,
    ) -> Answer:
        try:
            connection = await self.streams.open(
                engine.url, route, content, self.auth.apply(headers), stream=stream
            )
        except StreamError as e:
            raise _Failed(e.kind, e.message) from None
        status, content_type = connection.status, connection.content_type
        if connection.is_stream:
            return Answer(engine, status, content_type, stream=connection)
        body = connection.body()
        connection.release()
        if status in _RETRYABLE:
            raise _Failed(f"status_{status}", f"answered {status}: {error_message(body)}")
        return Answer(engine, status, content_type or "application/json", body)

    def response(
        self,
        answer: Answer,
        route: str,
        started: float,
        extra_headers: Mapping[str, str] | None = None,
        migrator: Migrator | None = None,
        log: StreamLog | None = None,
    ) -> Response:
        """The client's response for `answer`; a stream's end releases the engine. A stream
        with a `migrator` (and the `log` of its events) moves to another engine if it breaks."""
        headers = {"x-baton-engine": answer.engine.url, **(extra_headers or {})}
        if answer.stream is None:
            self.metrics.duration(route, time.perf_counter() - started)
            return Response(
                without_kv_params(answer.body),
                answer.status,
                headers=headers,
                media_type=answer.content_type,
            )
        self.metrics.first_byte(route, time.perf_counter() - started)
        return _PassThrough(self, answer, route, started, headers, migrator, log)


class _PassThrough(Response):
    """An engine's event stream, sent on as it arrives. Its end, or the client's departure,
    closes the engine connection (or pools it, when the answer ended whole) and releases the
    engine exactly once. With a `Migrator`, a stream that breaks goes on from another engine
    (each released in turn).

    Each piece of the engine's body is framed by the stream's log and written on the client's
    connection from inside the read that brought it (`EngineConnection.attach`, the server's
    `body_writer`): no task wakes for a chunk. Only a chunk the server cannot write at once (the
    client reads slower than the engine writes, or an in-process server without the writer)
    wakes the pump task, which sends it through `send` (waiting for the client to drain) while
    the engine connection's reading is paused. One watcher task per stream waits for the
    client's disconnect and, if it comes, closes the engine connection, which ends the pump.
    """

    def __init__(
        self,
        upstream: Upstream,
        answer: Answer,
        route: str,
        started: float,
        headers: Mapping[str, str],
        migrator: Migrator | None,
        log: StreamLog | None,
    ) -> None:
        self._upstream = upstream
        self._answer = answer
        self._route = route
        self._started = started
        self._migrator = migrator
        self._log = log
        self._client_gone = False
        self._write: Callable[[bytes], bool] | None = None
        self.status_code = answer.status
        self.media_type = answer.content_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._write = body_writer(scope)
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            await self._pump(send)
        finally:
            watcher.cancel()
            self._release()
            self._upstream.metrics.duration(self._route, time.perf_counter() - self._started)

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self._answer.status,
                    "headers": self.raw_headers})  # fmt: skip
        end = b""
        while (why := await self._relay(send)) is not None and not self._client_gone:
            engine, connection = self._answer.engine, self._answer.stream
            if connection is not None and connection.fault is not None:  # ours: logged there
                end = APIError(500, f"the router failed to relay the stream: {why}").sse() + _DONE
                break
            logger.warning("stream from %s broke: %s", engine.url, why)
            self._upstream.health.on_failure(engine, "stream")
            log, migrator = self._log, self._migrator
            if log is not None and log.finished:  # the answer is whole: only [DONE] is missing
                end = _DONE
                break
            try:
                if migrator is None or log is None:
                    raise APIError(502, f"the engine's stream broke: {why}")
                answer = await migrator.resume(engine, log, why)
            except APIError as error:
                end = error.sse() + _DONE
                break
            self._release()
            self._answer = answer
            if self._client_gone:
                break  # left while the new engine was found: released on the way out
        await send({"type": "http.response.body", "body": end, "more_body": False})

    async def _relay(self, send: Send) -> str | None:
        """Sends the current engine's stream on; None when it ended well, else what broke."""
        connection, log, write = self._answer.stream, self._log, self._write
        assert connection is not None
        held: list[bytes] = []  # framed, for `send`: the server could not write them at once

        def sink(piece: bytes) -> None:
            out = piece if log is None else log.feed(piece)
            if out and (held or write is None or not write(out)):
                held.append(out)
                connection.pause_reading()
                connection.wake()
            if log is not None and log.error is not None:
                connection.close()  # nothing more of it goes on

        connection.attach(sink)
        while True:
            await connection.wait_for(lambda: bool(held))
            while held and not self._client_gone:
                out = b"".join(held)
                held.clear()
                await send({"type": "http.response.body", "body": out, "more_body": True})
            connection.resume_reading()
            if connection.ended.done() or self._client_gone:
                break
        if log is not None and log.error is not None:
            return f"the engine sent an error: {log.error}"
        why = connection.ended.result() if connection.ended.done() else "the client left"
        if why is not None:
            return why
        if log is not None and not log.done:
            return "the stream ended before data: [DONE]"
        return None

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._client_gone = True
        connection = self._answer.stream
        if connection is not None:
            connection.close()  # the engine sees the disconnect and aborts; the pump ends

    def _release(self) -> None:
        answer = self._answer
        if answer.stream is None:
            return
        connection, answer.stream = answer.stream, None
        answer.engine.in_flight -= 1
        if self._client_gone:
            connection.close()
        else:
            connection.release()  # pooled when its answer ended whole, else closed


def without_kv_params(body: bytes | None) -> bytes | None:
    """An engine's whole answer without its `kv_transfer_params` (engine id, address, block ids
    and lease of its KV: nothing a client may hold or replay)."""
    if not body or b"kv_transfer_params" not in body:
        return body  # the common answer, passed on without a parse
    try:
        answer = json.loads(body)
    except ValueError:
        return body
    if not isinstance(answer, dict) or "kv_transfer_params" not in answer:
        return body  # the words were in the text, not a field
    del answer["kv_transfer_params"]
    return json.dumps(answer).encode()
