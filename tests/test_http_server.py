"""The shared HTTP server lifecycle: listen settings, serve and stop, the read deadline, and
work cancelled when its client leaves."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.types import Message, Receive, Scope, Send

from baton.http_server import ClientGone, HTTPServer, ListenConfig, cancel_on_disconnect


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _ok(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _request(messages: list[Message]) -> Request:
    """A request whose `receive` hands out `messages`, then waits forever."""

    async def receive() -> Message:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return Request({"type": "http", "method": "POST", "headers": []}, receive)


def test_listen_config_refuses_nonsense() -> None:
    """Ports outside 0-65535 and non-positive timeouts are refused with the field's name."""
    with pytest.raises(ValueError, match="port"):
        ListenConfig(port=70000)
    with pytest.raises(ValueError, match="shutdown_timeout"):
        ListenConfig(shutdown_timeout=-1)
    with pytest.raises(ValueError, match="request_read_timeout"):
        ListenConfig(request_read_timeout=0)


@pytest.mark.asyncio
async def test_serves_until_stopped() -> None:
    """`serve` answers requests until `stop`, then returns with `started` set."""
    port = _free_port()
    http = HTTPServer(_ok, ListenConfig(host="127.0.0.1", port=port), lifespan="off",
                      graceful_shutdown=1)  # fmt: skip
    serving = asyncio.create_task(http.serve())
    async with httpx.AsyncClient() as client:
        for _ in range(100):
            try:
                response = await client.get(f"http://127.0.0.1:{port}/")
                break
            except httpx.ConnectError:
                await asyncio.sleep(0.05)
        else:
            pytest.fail("the server never listened")
    assert response.text == "ok"
    assert not http.stopping
    http.stop()
    assert http.stopping
    await asyncio.wait_for(serving, 10)
    assert http.started


@pytest.mark.asyncio
async def test_a_taken_port_exits_without_starting() -> None:
    """When the port is taken, uvicorn exits (code 3) without having started."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        http = HTTPServer(_ok, ListenConfig(host="127.0.0.1", port=port), lifespan="off",
                          graceful_shutdown=1)  # fmt: skip
        with pytest.raises(SystemExit) as exc:  # awaited in this task: a task would re-raise it
            await http.serve()
        assert exc.value.code == 3
    assert not http.started


@pytest.mark.asyncio
async def test_a_request_that_stalls_is_cut_at_the_read_deadline() -> None:
    """A client that sends half its headers and stalls is disconnected after the deadline."""
    port = _free_port()
    listen = ListenConfig(host="127.0.0.1", port=port, request_read_timeout=0.5)
    http = HTTPServer(_ok, listen, lifespan="off", graceful_shutdown=1)
    serving = asyncio.create_task(http.serve())
    try:
        for _ in range(100):
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                break
            except OSError:
                await asyncio.sleep(0.05)
        else:
            pytest.fail("the server never listened")
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # no blank line: the headers never end
        await writer.drain()
        started = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, unanswered
        assert asyncio.get_running_loop().time() - started >= 0.4
        writer.close()
    finally:
        http.stop()
        await asyncio.wait_for(serving, 10)


@pytest.mark.asyncio
async def test_work_that_finishes_first_gives_its_result() -> None:
    """Work done before any disconnect returns its value."""

    async def work() -> int:
        return 7

    assert await cancel_on_disconnect(_request([]), work()) == 7


@pytest.mark.asyncio
async def test_a_client_that_leaves_cancels_the_work() -> None:
    """A disconnect cancels the work, waits for its cleanup, then raises ClientGone."""
    cleaned = asyncio.Event()

    async def work() -> Any:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.set()

    request = _request([{"type": "http.request", "body": b"", "more_body": False},
                        {"type": "http.disconnect"}])  # fmt: skip
    with pytest.raises(ClientGone):
        await asyncio.wait_for(cancel_on_disconnect(request, work()), 5)
    assert cleaned.is_set()
