"""The router's requests to the engines, read on an asyncio protocol that hands an event
stream's body on inside the read that brought it.

aiohttp reads an answer into a `StreamReader` and wakes the reading task once per chunk; at 64
streams on one core a chunk then costs the router about 100 µs, most of it in that wake-up and
the layers around it (docs/router.md). The router's requests take this path instead: httptools'
response parser (the one uvicorn parses requests with) on a plain protocol, and a `sink` the
protocol calls with what each read brought of a stream's body, so that a chunk crosses the
router from socket to socket without a task (and the events of one read, when the router is
behind, in one write). Whole answers take it too (aiohttp's client cost a whole completion
0.15-0.25 ms more of the router's CPU, docs/router.md); the health probes, scrapes and the
tokenizer's fetch stay on aiohttp, whose pool this one does not share.

`EngineStreams.open` sends the request and waits for the answer's head: a 200 event stream to a
streamed request is returned with its first body bytes in (until then the engine may still be
swapped for another); any other answer is read whole. A connection whose answer ended whole
goes back to a pool of idle connections per engine, at most `max_connections` open at once (a
request waits, within the request timeout, for one to free up; at the bound a connection is
closed rather than pooled); a stream cut midway is closed. No byte from an engine for
`request_timeout` seconds ends its answer, as aiohttp's read timeout did (not while the router
itself has paused reading).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

import httptools

# A reused connection that the engine closed while it was idle fails before any byte of the
# answer, within a round trip of the request; the request then goes once more on a new
# connection. One that fails later without a byte failed while the engine worked on it (a
# whole answer sends nothing until it is done): that is the engine's failure, tried elsewhere,
# never sent to the same engine again. Idle ones are not kept past `_IDLE_SECONDS` (uvicorn
# closes a keep-alive connection after 5 s idle by default).
_IDLE_SECONDS = 4.0
_STALE_SECONDS = 0.5
logger = logging.getLogger(__name__)
_SKIPPED = frozenset(("host", "content-length", "transfer-encoding", "connection"))


class StreamError(Exception):
    """A request that got no usable answer: `kind` is "connect", "timeout" or "broken"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class EngineConnection(asyncio.Protocol):
    """One connection to an engine, one request at a time. Pieces of an answer's body are kept
    until a `sink` is attached, then handed to it a read at a time; `ended` (None: the answer
    ended whole, else why not) resolves once."""

    def __init__(self, streams: EngineStreams, origin: tuple[str, int, bool]) -> None:
        self._streams = streams
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self._loop = asyncio.get_running_loop()
        self._reset()

    def _reset(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.content_type = ""
        self._framed = False  # a content-length or chunked body: its end is in the bytes
        self._pieces: list[bytes] = []  # the body's pieces before a sink is attached
        self._batch: list[bytes] = []  # this read's pieces for the sink
        self._sink: Callable[[bytes], None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.busy = False  # a request was sent and its answer has not ended
        self.head_in = False
        self.timed_out = False
        self.fault: Exception | None = None  # the router's own failure on a piece (its sink)
        self._paused = False
        self.wants_stream = True  # the request streams: a 200 event stream is not read whole
        self.is_stream = False  # a 200 event stream, returned with its first bytes in
        self.got_bytes = False
        self.sent_at = self.lost_at = 0.0  # loop times of the request and of the connection's loss
        self.complete = False
        self._keep_alive = True
        self.ended: asyncio.Future[str | None] = self._loop.create_future()
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TLS one is no subclass

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # bytes on an idle connection answer nothing we asked: not reusable
            self.close()
            return
        self.got_bytes = True
        self._last_read = self._loop.time()
        error = None
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            error = f"the engine's answer could not be parsed: {e}"
        self._flush()  # what the read brought before any error
        if error is not None:
            self._end(error)

    def connection_lost(self, exc: Exception | None) -> None:
        self._streams.forget(self)
        self.lost_at = self._loop.time()
        if self.head_in and not self._framed and not self.complete:
            self.on_message_complete()  # a body that ends with its connection
        why = f"{type(exc).__name__}: {exc}" if exc else "the engine closed the connection"
        self._end(why)

    # -- httptools' callbacks --

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self.content_type = value.decode("latin-1").strip()
        elif name in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._keep_alive = self._parser.should_keep_alive()
        self.head_in = True
        self.is_stream = (
            self.wants_stream
            and self.status == 200
            and self.content_type.startswith("text/event-stream")
        )
        self.wake()

    def on_body(self, body: bytes) -> None:
        if self.ended.done():
            return  # the rest of a read after the answer was cut (an error event, a fault)
        if self._sink is not None:
            self._batch.append(body)  # handed on at the read's end, with the read's other pieces
        else:
            self._pieces.append(body)
            self.wake()

    def on_message_complete(self) -> None:
        self._flush()  # before the end: a fault of the sink on the last piece is the end's why
        self.complete = True
        self.busy = False
        self._end(None)

    def _flush(self) -> None:
        """Hands the sink what this read brought, as one piece: a router that fell behind its
        engines finds several events in a read and sends them on in one write, not one each."""
        batch, self._batch = self._batch, []
        if batch:
            self._deliver(batch[0] if len(batch) == 1 else b"".join(batch))

    def _deliver(self, piece: bytes) -> None:
        if self._sink is None or self.fault is not None:
            return
        try:
            self._sink(piece)
        except Exception as e:  # the router's fault, not the engine's: said apart
            logger.exception("relaying a piece of an engine's answer failed")
            self.fault = e
            self._end(f"the router failed: {type(e).__name__}: {e}")

    # -- the request's side --

    def wake(self) -> None:
        """Wakes the task in `wait_for`, to look at its condition again."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _end(self, why: str | None) -> None:
        if not self.ended.done():
            self.ended.set_result(why)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if why is not None and self.transport is not None:
            self.transport.close()
        self.wake()

    def send(self, request: bytes, read_timeout: float, stream: bool) -> None:
        """Writes `request` (`stream`: its answer may be an event stream, passed on as it comes);
        from now on, no byte from the engine for `read_timeout` seconds ends the answer
        (`timed_out`)."""
        assert self.transport is not None
        self.busy = True
        self.wants_stream = stream
        self.transport.write(request)
        self._last_read = self.sent_at = self._loop.time()

        def check() -> None:  # re-armed only when it fires: a read just stamps its time
            idle = self._loop.time() - self._last_read
            if idle < read_timeout or self._paused:  # paused: the engine is not the one late
                self._timer = self._loop.call_later(read_timeout - idle, check)
                return
            self._timer = None
            self.timed_out = True
            self._end(f"TimeoutError: no bytes from the engine for {read_timeout:g} s")

        self._timer = self._loop.call_later(read_timeout, check)

    async def wait_for(self, ready: Callable[[], bool]) -> None:
        """Until `ready()` or the answer's end."""
        while not ready() and not self.ended.done():
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def attach(self, sink: Callable[[bytes], None]) -> None:
        """Hands the body read so far, then each later read's, to `sink`."""
        pieces, self._pieces = self._pieces, []
        self._sink = sink
        if pieces:
            self._deliver(b"".join(pieces))

    def body(self) -> bytes:
        return b"".join(self._pieces)

    def stale(self) -> bool:
        """Failed as a pooled connection the engine had closed while idle does: no byte of the
        answer, and lost within `_STALE_SECONDS` of the request."""
        fast = self.lost_at > 0 and 0 <= self.lost_at - self.sent_at < _STALE_SECONDS
        return fast and not self.got_bytes and not self.timed_out

    def pause_reading(self) -> None:
        """Stops reading (the client is behind); the read timeout waits with it."""
        if self.transport is not None and not self.transport.is_closing():
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self.transport is not None and not self.transport.is_closing():
            self._paused = False
            self._last_read = self._loop.time()
            self.transport.resume_reading()

    def close(self) -> None:
        """Ends the answer where it is, and the connection with it."""
        self._end("closed by the router")  # closes the transport; a set `ended` stays as it is
        self._streams.forget(self)

    def release(self) -> None:
        """Back to the pool when its answer ended whole on a reusable connection, else closed."""
        transport = self.transport
        if self.complete and self._keep_alive and transport and not transport.is_closing():
            self._reset()
            self._streams.idle(self)
            return
        self.close()


class EngineStreams:
    """Every proxied request's connection to the engines: opened, pooled and bounded."""

    def __init__(
        self,
        max_connections: int,
        connect_timeout: float,
        request_timeout: float,
        ssl_context: ssl.SSLContext | bool,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        # True: the system's CAs (aiohttp's meaning), made on the first https:// engine.
        self._ssl = ssl_context if isinstance(ssl_context, ssl.SSLContext) else None
        self._slots = asyncio.Semaphore(max_connections)
        self._open: set[EngineConnection] = set()  # holding a slot each
        self._idle: dict[tuple[str, int, bool], list[EngineConnection]] = {}
        self._origins: dict[str, tuple[tuple[str, int, bool], str]] = {}

    async def open(
        self, url: str, path: str, body: bytes, headers: Mapping[str, str], *, stream: bool
    ) -> EngineConnection:
        """`body` POSTed to `url` + `path`; the connection once its answer's head is in and,
        for a 200 event stream to a `stream` request, its first body bytes, else its whole body
        (`body()`). StreamError when there is no such answer."""
        origin, prefix = self._origin(url)
        request = _request(origin, prefix + path, body, headers)
        for reused in (True, False):
            connection = self._pooled(origin) if reused else None
            if reused and connection is None:
                continue
            if connection is None:
                connection = await self._connect(origin)
            connection.send(request, self.request_timeout, stream)
            try:
                await self._head(connection)
            except StreamError:
                connection.close()
                if reused and connection.stale():
                    continue  # the engine had closed it while it was idle
                raise
            except BaseException:
                connection.close()
                raise
            return connection
        raise AssertionError("unreachable")

    async def _head(self, connection: EngineConnection) -> None:
        await connection.wait_for(lambda: connection.head_in)
        if connection.is_stream:
            await connection.wait_for(lambda: bool(connection._pieces))
            if connection._pieces:
                return
        else:
            await connection.wait_for(lambda: False)  # the whole body
        why = connection.ended.result()
        if why is None and not connection.is_stream:
            return
        if connection.timed_out:
            raise StreamError("timeout", "timed out before the first byte")
        raise StreamError("broken", why or "the stream ended before its first byte")

    def _origin(self, url: str) -> tuple[tuple[str, int, bool], str]:
        """Where `url`'s connections go (pooled by it), and its path, which routes extend."""
        known = self._origins.get(url)
        if known is None:
            parts = urlsplit(url)
            tls = parts.scheme == "https"
            origin = (parts.hostname or "", parts.port or (443 if tls else 80), tls)
            known = self._origins[url] = (origin, parts.path.rstrip("/"))
        return known

    def _pooled(self, origin: tuple[str, int, bool]) -> EngineConnection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            transport = connection.transport
            fresh = now - connection.idle_since < _IDLE_SECONDS
            if fresh and transport is not None and not transport.is_closing():
                return connection
            connection.close()
        return None

    async def _connect(self, origin: tuple[str, int, bool]) -> EngineConnection:
        host, port, tls = origin
        if self._slots.locked():  # an idle connection to another engine gives its slot up
            oldest = min((c for idle in self._idle.values() for c in idle),
                         key=lambda c: c.idle_since, default=None)  # fmt: skip
            if oldest is not None:
                oldest.close()
        try:
            if self._slots.locked():
                async with asyncio.timeout(self.request_timeout):
                    await self._slots.acquire()
            else:
                await self._slots.acquire()  # at once
        except TimeoutError:
            raise StreamError("timeout", "timed out waiting for a free connection") from None
        loop = asyncio.get_running_loop()
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(
                    lambda: EngineConnection(self, origin),
                    host,
                    port,
                    ssl=self._ssl if tls else None,
                )
        except TimeoutError:
            self._slots.release()
            raise StreamError("timeout", "timed out connecting") from None
        except OSError as e:
            self._slots.release()
            raise StreamError("connect", f"{type(e).__name__}: {e}") from None
        except BaseException:
            self._slots.release()
            raise
        self._open.add(connection)
        return connection

    def idle(self, connection: EngineConnection) -> None:
        if self._slots.locked():  # at the bound, a request may wait for the slot it holds
            connection.close()
            return
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.origin, []).append(connection)

    def forget(self, connection: EngineConnection) -> None:
        """A closed connection gives its slot back (once)."""
        if connection in self._open:
            self._open.discard(connection)
            self._slots.release()
            idle = self._idle.get(connection.origin)
            if idle and connection in idle:
                idle.remove(connection)

    def close(self) -> None:
        for connection in list(self._open):
            connection.close()


def _request(
    origin: tuple[str, int, bool], path: str, body: bytes, headers: Mapping[str, str]
) -> bytes:
    host, port, tls = origin
    if ":" in host:
        host = f"[{host}]"  # an IPv6 address, as a URL writes it
    if port != (443 if tls else 80):  # the scheme's own port unsaid, as clients write Host
        host = f"{host}:{port}"
    lines = [f"POST {path} HTTP/1.1", f"host: {host}", f"content-length: {len(body)}"]
    for name, value in headers.items():
        if name.lower() in _SKIPPED:
            continue
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}")
    if not any(name.lower() == "content-type" for name in headers):
        lines.append("content-type: application/json")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
