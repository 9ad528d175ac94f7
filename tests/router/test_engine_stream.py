"""The router's streamed requests on their own protocol (`baton.router.engine_stream`), against
a scripted engine on a real socket: pieces reach the sink in order, connections are pooled,
replaced when the engine closed them, bounded and timed out."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from baton.ports import free_port
from baton.router import engine_stream
from baton.router.engine_stream import EngineStreams, StreamError

EVENTS = [b'data: {"id":"a","n":%d}\n\n' % i for i in range(3)] + [b"data: [DONE]\n\n"]
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)

Handler = Callable[[asyncio.StreamWriter, int], Awaitable[bool]]


async def _read_request(reader: asyncio.StreamReader) -> bytes | None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _stream(writer: asyncio.StreamWriter, pause: float = 0.0) -> None:
    writer.write(SSE_HEAD)
    for event in EVENTS:
        writer.write(_chunk(event))
        await writer.drain()
        if pause:
            await asyncio.sleep(pause)
    writer.write(b"0\r\n\r\n")
    await writer.drain()


@asynccontextmanager
async def _engine(answer: Handler) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A server that answers the `nth` request on a connection with `answer` (False: close the
    connection after it); yields its URL and the requests it got. Each connection appends
    b"connect"."""
    requests: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(b"connect")
        try:
            for nth in itertools.count():
                request = await _read_request(reader)
                requests.append(request or b"")
                if not await answer(writer, nth):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    port = free_port()
    server = await asyncio.start_server(serve, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}", requests
    finally:
        server.close()


def _streams(max_connections: int = 8, timeout: float = 5.0) -> EngineStreams:
    return EngineStreams(max_connections, 1.0, timeout, True)


async def _collect(streams: EngineStreams, url: str) -> tuple[list[bytes], str | None]:
    connection = await streams.open(
        url, "/v1/completions", b"{}", {"x-request-id": "r1"}, stream=True
    )
    assert connection.is_stream and connection.status == 200
    pieces: list[bytes] = []
    connection.attach(pieces.append)
    why = await asyncio.wait_for(connection.ended, 5)
    connection.release()
    return pieces, why


async def _whole_streams(streams: EngineStreams, url: str, count: int) -> None:
    for _ in range(count):
        pieces, why = await _collect(streams, url)
        assert why is None and b"".join(pieces) == b"".join(EVENTS)


@pytest.mark.asyncio
async def test_pieces_reach_the_sink_in_order_and_the_connection_is_reused() -> None:
    """Events sent apart arrive whole and in order (those read before `attach` first); the
    answer ends whole, and the next request goes on the same connection with our headers."""

    async def answer(writer: asyncio.StreamWriter, nth: int) -> bool:
        await _stream(writer, pause=0.01)
        return True

    async with _engine(answer) as (url, requests):
        streams = _streams()
        await _whole_streams(streams, url, 2)
        assert requests.count(b"connect") == 1
        request = requests[1]
        assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert b"x-request-id: r1\r\n" in request and request.endswith(b"\r\n\r\n{}")
        streams.close()


@pytest.mark.asyncio
async def test_the_events_of_one_read_reach_the_sink_as_one_piece() -> None:
    """An engine that got ahead of the router: the events one read brought go to the sink in
    one call (one write to the client), whole and in order; what came before `attach` too."""
    sent = asyncio.Event()

    async def answer(writer: asyncio.StreamWriter, nth: int) -> bool:
        writer.write(SSE_HEAD + _chunk(EVENTS[0]) + _chunk(EVENTS[1]))  # one write
        await writer.drain()
        await sent.wait()  # until the router has handed those on
        writer.write(b"".join(_chunk(e) for e in EVENTS[2:]) + b"0\r\n\r\n")  # one write
        await writer.drain()
        return True

    async with _engine(answer) as (url, _):
        streams = _streams()
        connection = await streams.open(url, "/v1/completions", b"{}", {}, stream=True)
        pieces: list[bytes] = []

        def sink(piece: bytes) -> None:
            pieces.append(piece)
            sent.set()

        connection.attach(sink)
        assert pieces == [EVENTS[0] + EVENTS[1]]
        assert await asyncio.wait_for(connection.ended, 5) is None
        assert pieces == [EVENTS[0] + EVENTS[1], EVENTS[2] + EVENTS[3]]
        connection.release()
        streams.close()


@pytest.mark.asyncio
async def test_a_whole_answer_is_read_whole() -> None:
    """Any answer but a 200 event stream comes back whole, with its status and type."""
    body = b'{"error":{"message":"no","code":400}}'

    async def answer(writer: asyncio.StreamWriter, nth: int) -> bool:
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(body))  # fmt: skip
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(body)  # the body after the head, in another read
        return True

    async with _engine(answer) as (url, _):
        streams = _streams()
        connection = await streams.open(url, "/v1/completions", b"{}", {}, stream=True)
        assert (connection.status, connection.is_stream) == (400, False)
        assert connection.content_type == "application/json" and connection.body() == body
        connection.release()
        streams.close()


@pytest.mark.asyncio
async def test_an_event_stream_to_a_request_that_does_not_stream_is_read_whole() -> None:
    """A whole answer is what a request that did not stream gets, whatever the engine sent; the
    connection is pooled after it."""

    async def answer(writer: asyncio.StreamWriter, nth: int) -> bool:
        await _stream(writer, pause=0.01)
        return True

    async with _engine(answer) as (url, requests):
        streams = _streams()
        for _ in range(2):
            connection = await streams.open(url, "/v1/completions", b"{}", {}, stream=False)
            assert (connection.status, connection.is_stream) == (200, False)
            assert connection.ended.result() is None and connection.body() == b"".join(EVENTS)
            connection.release()
        assert requests.count(b"connect") == 1
        streams.close()


@pytest.mark.asyncio
async def test_a_connection_the_engine_closed_while_idle_is_replaced() -> None:
    """A pooled connection that the engine closes, unanswered, when the next request comes
    on it (its keep-alive ran out as the request left): the request goes again on a new
    connection, and the client sees nothing of it."""

    async def answer(writer: asyncio.StreamWriter, nth: int) -> bool:
        if nth > 0:
            return False  # closed without a byte
        await _stream(writer)
        return True

    async with _engine(answer) as (url, requests):
        streams = _streams()
        await _whole_streams(streams, url, 3)
        assert requests.count(b"connect") == 3
        assert len(requests) == 3 + 5  # the 2nd and 3rd requests went twice
        streams.close()


@pytest.mark.asyncio
async def test_an_engine_that_stops_sending_times_out() -> None:
    """No byte for the request timeout: before the answer's head a StreamError("timeout");
    mid-stream the answer ends with the reason and the connection is not pooled."""

    async def silent(writer: asyncio.StreamWriter, nth: int) -> bool:
        await asyncio.sleep(10)
        return False

    async with _engine(silent) as (url, _):
        streams = _streams(timeout=0.3)
        with pytest.raises(StreamError) as timed_out:
            await streams.open(url, "/v1/completions", b"{}", {}, stream=True)
        assert timed_out.value.kind == "timeout"
        streams.close()

    async def stalls(writer: asyncio.StreamWriter, nth: int) -> bool:
        writer.write(SSE_HEAD + _chunk(EVENTS[0]))
        await writer.drain()
        await asyncio.sleep(10)
        return False

    async with _engine(stalls) as (url, requests):
        streams = _streams(timeout=0.3)
        pieces, why = await _collect(streams, url)
        assert pieces == [EVENTS[0]] and why is not None and "TimeoutError" in why
        await _collect(streams, url)  # on a new connection: the cut one was closed
        assert requests.count(b"connect") == 2
        streams.close()


@pytest.mark.asyncio
async def test_a_reused_connection_that_times_out_is_not_sent_again() -> None:
    """A request on a pooled connection that gets no byte within the timeout fails as a
    timeout; it is not sent a second time (the engine may be computing it)."""

    async def answer(writer: asyncio.StreamWriter, nth: int) -> bool:
        if nth > 0:
            await asyncio.sleep(10)
        await _stream(writer)
        return True

    async with _engine(answer) as (url, requests):
        streams = _streams(timeout=0.3)
        await _whole_streams(streams, url, 1)
        with pytest.raises(StreamError) as timed_out:
            await streams.open(url, "/v1/completions", b"{}", {}, stream=True)
        assert timed_out.value.kind == "timeout"
        assert requests.count(b"connect") == 1 and len(requests) == 3
        streams.close()


@pytest.mark.asyncio
async def test_a_reused_connection_lost_while_the_engine_worked_is_not_sent_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A whole answer sends nothing until it is done: a pooled connection lost without a byte
    after the engine had it for a while is the engine's failure (a "broken" StreamError, for
    the caller to try elsewhere), not a stale connection: the request is not sent again."""
    monkeypatch.setattr(engine_stream, "_STALE_SECONDS", 0.1)

    async def answer(writer: asyncio.StreamWriter, nth: int) -> bool:
        if nth > 0:
            await asyncio.sleep(0.3)  # working on it, then gone
            return False
        await _stream(writer)
        return True

    async with _engine(answer) as (url, requests):
        streams = _streams()
        await _whole_streams(streams, url, 1)
        with pytest.raises(StreamError) as lost:
            await streams.open(url, "/v1/completions", b"{}", {}, stream=False)
        assert lost.value.kind == "broken"
        assert requests.count(b"connect") == 1 and len(requests) == 3
        streams.close()


@pytest.mark.asyncio
async def test_a_paused_connection_waits_without_timing_out() -> None:
    """While the router does not read (its client is behind), the read timeout waits too:
    the answer ends whole after a pause three times the timeout."""

    async def answer(writer: asyncio.StreamWriter, nth: int) -> bool:
        await _stream(writer, pause=0.05)
        return True

    async with _engine(answer) as (url, _):
        streams = _streams(timeout=0.3)
        connection = await streams.open(url, "/v1/completions", b"{}", {}, stream=True)
        pieces: list[bytes] = []
        connection.attach(pieces.append)
        connection.pause_reading()
        await asyncio.sleep(1.0)
        assert not connection.ended.done()
        connection.resume_reading()
        assert await asyncio.wait_for(connection.ended, 5) is None
        assert b"".join(pieces) == b"".join(EVENTS)
        connection.release()
        streams.close()


@pytest.mark.asyncio
async def test_a_failing_sink_is_the_routers_fault_and_a_url_path_is_kept() -> None:
    """An exception in the sink ends the answer as the router's fault (`fault`, logged), not
    as a parse error of the engine's; a path in the engine's URL prefixes the route."""

    async def answer(writer: asyncio.StreamWriter, nth: int) -> bool:
        await _stream(writer, pause=0.02)
        return True

    def sink(piece: bytes) -> None:
        raise ValueError("a bug")

    async with _engine(answer) as (url, requests):
        streams = _streams()
        connection = await streams.open(url + "/prefix", "/v1/completions", b"{}", {}, stream=True)
        assert requests[1].startswith(b"POST /prefix/v1/completions HTTP/1.1\r\n")
        connection.attach(sink)
        why = await asyncio.wait_for(connection.ended, 5)
        assert isinstance(connection.fault, ValueError)
        assert why is not None and why.startswith("the router failed: ValueError")
        connection.release()
        streams.close()


@pytest.mark.asyncio
async def test_a_sink_that_fails_on_the_last_read_ends_the_answer_as_the_routers_fault() -> None:
    """The read that completes the answer hands its pieces on before the answer ends, so a
    fault there is the end's reason, not a whole answer."""

    async def answer(writer: asyncio.StreamWriter, nth: int) -> bool:
        writer.write(SSE_HEAD + _chunk(EVENTS[0]))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"".join(_chunk(e) for e in EVENTS[1:]) + b"0\r\n\r\n")  # one read
        await writer.drain()
        return True

    pieces: list[bytes] = []

    def sink(piece: bytes) -> None:
        pieces.append(piece)
        if len(pieces) == 2:
            raise ValueError("a bug")

    async with _engine(answer) as (url, _):
        streams = _streams()
        connection = await streams.open(url, "/v1/completions", b"{}", {}, stream=True)
        connection.attach(sink)
        why = await asyncio.wait_for(connection.ended, 5)
        assert pieces == [EVENTS[0], b"".join(EVENTS[1:])]
        assert why is not None and why.startswith("the router failed: ValueError")
        connection.release()
        streams.close()


def test_the_host_header_names_a_port_only_where_it_is_not_the_schemes() -> None:
    """As clients write `Host`: a virtual host matched on it sees what it would from any other."""
    for origin, host in [
        (("engine", 80, False), b"host: engine\r\n"),
        (("engine", 443, True), b"host: engine\r\n"),
        (("engine", 8000, False), b"host: engine:8000\r\n"),
        (("engine", 80, True), b"host: engine:80\r\n"),
        (("::1", 8000, False), b"host: [::1]:8000\r\n"),
    ]:
        assert host in engine_stream._request(origin, "/v1/completions", b"{}", {})


@pytest.mark.asyncio
async def test_connections_are_bounded() -> None:
    """With one connection allowed, a second request waits until the first stream's
    connection is closed (not pooled: a request waits for its slot), then opens its own."""

    async def answer(writer: asyncio.StreamWriter, nth: int) -> bool:
        await _stream(writer)
        return True

    async with _engine(answer) as (url, requests):
        streams = _streams(max_connections=1)
        first = await streams.open(url, "/v1/completions", b"{}", {}, stream=True)
        second = asyncio.ensure_future(streams.open(url, "/v1/completions", b"{}", {}, stream=True))
        await asyncio.sleep(0.2)
        assert not second.done()
        first.attach(lambda piece: None)
        await first.ended
        first.release()
        connection = await asyncio.wait_for(second, 5)
        assert connection is not first and requests.count(b"connect") == 2
        connection.release()
        streams.close()


@pytest.mark.asyncio
async def test_refusals_are_explicit() -> None:
    """Nothing listening is a "connect" failure; a header value with a line break (which
    would start a header of its own) is refused before anything is sent."""
    streams = _streams()
    with pytest.raises(StreamError) as refused:
        await streams.open(
            f"http://127.0.0.1:{free_port()}", "/v1/completions", b"{}", {}, stream=True
        )
    assert refused.value.kind == "connect"
    with pytest.raises(ValueError, match="line break"):
        await streams.open(
            "http://127.0.0.1:1", "/x", b"", {"x-request-id": "a\r\nhost: b"}, stream=True
        )
    streams.close()
