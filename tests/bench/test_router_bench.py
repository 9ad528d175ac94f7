"""Tests of bench/router.py's own processes: the fake engine's two pacings and the byte relay
that gives the floor of a Python data path."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

from bench.router import PROMPT, _request, _stop, load, start_engine, start_relay

ITL = 0.1


def _arrivals(sock: socket.socket) -> list[float]:
    """The time at which each token's event of a stream arrives, up to its `data: [DONE]`."""
    times: list[float] = []
    buffer = b""
    while True:
        data = sock.recv(65536)
        assert data, "the engine closed the stream before data: [DONE]"
        now = time.monotonic()
        buffer += data
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if b"data: [DONE]" in event:
                return times
            times.append(now)


def _two_streams(pacing: str) -> tuple[list[float], list[float]]:
    """A stream of one token (which must end, and leave the engine pacing the next ones), then
    two streams of 4 tokens, the second asked for 0.3 ITL after the first."""
    engine, (port,) = start_engine(1, ITL, None, pacing)
    try:
        first = socket.create_connection(("127.0.0.1", port))
        second = socket.create_connection(("127.0.0.1", port))
        for sock in (first, second):
            sock.settimeout(10)
        first.sendall(_request(PROMPT, 1, True))
        assert len(_arrivals(first)) == 1
        request = _request(PROMPT, 4, True)
        with ThreadPoolExecutor(2) as pool:  # both read as the events come
            reads = [pool.submit(_arrivals, sock) for sock in (first, second)]
            first.sendall(request)
            time.sleep(0.3 * ITL)
            second.sendall(request)
            a, b = (read.result(10) for read in reads)
        first.close()
        second.close()
        return a, b
    finally:
        _stop(engine)


def test_steps_give_every_stream_its_token_in_the_same_moment() -> None:
    a, b = _two_streams("steps")
    assert len(a) == len(b) == 4
    # After its first event (sent on arrival), the second stream rides the first one's steps.
    for x, y in zip(a[1:], b[1:], strict=True):
        assert abs(x - y) < 0.2 * ITL
    assert all(later - earlier > 0.7 * ITL for earlier, later in pairwise(a[1:]))


def test_independent_streams_keep_clocks_of_their_own() -> None:
    a, b = _two_streams("independent")
    assert len(a) == len(b) == 4
    for x, y in zip(a, b, strict=True):
        assert 0.1 * ITL < y - x < 0.6 * ITL


def test_the_byte_relay_carries_whole_answers_and_streams() -> None:
    engine, (engine_port,) = start_engine(1, 0.0, None)
    relay, port = start_relay(engine_port, None)
    try:
        for stream in (False, True):
            result = load(port, [_request(PROMPT, 8, stream)], 20, 4, 1, None)
            assert result["requests_per_s"] > 0
            assert result["ttft_p50_ms"] <= result["p50_ms"]
    finally:
        _stop(engine, relay)
