"""Sending one request to an engine, with retries on other engines before the first byte.

`Upstream.send` tries engines in the order a `pick` callback gives them. An attempt fails when
the connection fails, times out, or the engine answers 401/502/503/504 (or, streaming, breaks
before its first body bytes); the next engine is tried, up to `max_retries` more. A 429 is
backpressure, not failure: the next engine is tried and, if every engine tried answered 429,
so does the router. Any other answer (2xx, 4xx, 500) goes to the client as it is.

Once an answer's first bytes are in, the engine is committed: a stream is passed through chunk
by chunk as it arrives, never buffered. A stream that breaks later (its connection, an error
event, no `data: [DONE]`) migrates to another engine when it can (`migration`); otherwise it
ends with an error event and `data: [DONE]` rather than a hang. A whole answer reaches the
client without the engine's `kv_transfer_params` (where an engine's KV blocks wait is the
router's business alone).

Every attempt carries the engines' key and TLS settings (`UpstreamAuth`), whatever headers
its caller passed: the client's `Authorization` never reaches an engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import aiohttp
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from baton.errors import APIError
from baton.router.config import RouterConfig
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
    `stream` (the rest of an event stream, `first_chunk` already read) is set."""

    engine: EngineState
    status: int
    content_type: str
    body: bytes | None = None
    stream: aiohttp.ClientResponse | None = None
    chunks: AsyncIterator[bytes] | None = None
    first_chunk: bytes = b""


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
        session: Callable[[], aiohttp.ClientSession],
        health: HealthMonitor,
        metrics: RouterMetrics,
        config: RouterConfig,
    ) -> None:
        self.session = session
        self.health = health
        self.metrics = metrics
        self.max_retries = config.max_retries
        self.auth = UpstreamAuth(config)

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
            response = await self.session().post(
                engine.url + route,
                data=content,
                headers=self.auth.apply(headers),
                ssl=self.auth.ssl,
            )
        except TimeoutError as e:
            raise _Failed("timeout", f"timed out ({type(e).__name__})") from None
        except aiohttp.ClientError as e:
            raise _Failed("connect", f"{type(e).__name__}: {e}") from None
        status = response.status
        content_type = response.headers.get("content-type", "application/json")
        try:
            if stream and status == 200 and content_type.startswith("text/event-stream"):
                chunks = response.content.iter_any()
                first = b""
                async for piece in chunks:  # up to the first non-empty body bytes
                    if piece:
                        first = piece
                        break
                if not first:
                    raise _Failed("broken", "the stream ended before its first byte")
                return Answer(engine, status, content_type, None, response, chunks, first)
            body = await response.read()
        except TimeoutError:
            response.close()
            raise _Failed("timeout", "timed out before the first byte") from None
        except aiohttp.ClientError as e:
            response.close()
            raise _Failed("broken", f"{type(e).__name__}: {e}") from None
        except BaseException:
            response.close()
            raise
        response.release()
        if status in _RETRYABLE:
            raise _Failed(f"status_{status}", f"answered {status}: {error_message(body)}")
        return Answer(engine, status, content_type, body)

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
        if answer.stream is None or answer.chunks is None:
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
    """An engine's event stream, sent on chunk by chunk as it arrives. Its end, or the
    client's departure, closes the engine connection and releases the engine exactly once.
    With a `Migrator`, a stream that breaks goes on from another engine (each released in
    turn).

    Not Starlette's StreamingResponse: that runs a task group per response and a generator
    per chunk, which at 64 streams on two cores cost more than everything else the router
    does. Here one watcher task per stream waits for the client's disconnect and, if it comes,
    closes the engine connection, which ends the pump.
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
        self.status_code = answer.status
        self.media_type = answer.content_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
            engine = self._answer.engine
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
        answer, log = self._answer, self._log
        assert answer.chunks is not None
        try:
            if not await self._forward(send, answer.first_chunk):
                return f"the engine sent an error: {log.error if log else ''}"
            async for chunk in answer.chunks:
                if not await self._forward(send, chunk):
                    return f"the engine sent an error: {log.error if log else ''}"
        except (aiohttp.ClientError, TimeoutError) as e:
            return f"{type(e).__name__}: {e}"
        if log is not None and not log.done:
            return "the stream ended before data: [DONE]"
        return None

    async def _forward(self, send: Send, chunk: bytes) -> bool:
        """Sends `chunk` on (what of it the log lets through); False at an error event."""
        log = self._log
        out = chunk if log is None else log.feed(chunk)
        if out:
            await send({"type": "http.response.body", "body": out, "more_body": True})
        return log is None or log.error is None

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._client_gone = True
        stream = self._answer.stream
        if stream is not None:
            stream.close()  # the engine sees the disconnect and aborts; the pump ends

    def _release(self) -> None:
        answer = self._answer
        if answer.stream is None:
            return
        stream, answer.stream = answer.stream, None
        answer.engine.in_flight -= 1
        if stream.content.at_eof() and not self._client_gone:
            stream.release()  # the connection goes back to the pool
        else:
            stream.close()  # cut midway: the connection cannot be reused


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
