"""The shared HTTP server lifecycle: listen settings, serve and stop, the read deadline, work
cancelled when its client leaves, the API key check and TLS."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.types import Message, Receive, Scope, Send

from baton.http_server import (
    API_KEY_ENV,
    ClientGone,
    HTTPServer,
    ListenConfig,
    add_listen_args,
    api_keys_from_args,
    body_writer,
    cancel_on_disconnect,
    freeze_startup_heap,
)
from baton.ports import free_port
from tests.support.tls import make_certs


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
    with pytest.raises(ValueError, match="empty key"):
        ListenConfig(api_keys=("",))
    with pytest.raises(ValueError, match="need ssl_certfile"):
        ListenConfig(ssl_keyfile="key.pem")
    assert "secret" not in repr(ListenConfig(api_keys=("secret",)))


@pytest.mark.asyncio
async def test_serves_until_stopped() -> None:
    """`serve` answers requests until `stop`, then returns with `started` set."""
    port = free_port()
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
async def test_body_chunks_written_past_send_arrive_whole_and_wait_for_a_slow_client() -> None:
    """`body_writer` writes a streamed body's chunks onto the connection at once; it refuses
    (False) before the response starts and while the client reads slower than the app writes
    (the app then awaits `send`, which waits for the client to drain); every byte arrives,
    in order, framed as uvicorn frames it."""
    seen: dict[str, int] = {}
    chunks = [b"%08d" % i + b"x" * 65536 for i in range(300)]  # 19 MiB: more than the buffers

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        write = body_writer(scope)
        assert write is not None and not write(b"early")
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        seen["direct"] = seen["sent"] = 0
        for chunk in chunks:
            if write(chunk):
                seen["direct"] += 1
            else:
                seen["sent"] += 1
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    port = free_port()
    http = HTTPServer(app, ListenConfig(host="127.0.0.1", port=port), lifespan="off",
                      graceful_shutdown=1)  # fmt: skip
    serving = asyncio.create_task(http.serve())
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(100):
                with contextlib.suppress(httpx.ConnectError):
                    async with client.stream("GET", f"http://127.0.0.1:{port}/") as response:
                        await asyncio.sleep(1.0)  # a slow reader: the server's writes pause
                        body = b"".join([piece async for piece in response.aiter_bytes()])
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("the server never listened")
    finally:
        http.stop()
        await asyncio.wait_for(serving, 10)
    assert body == b"".join(chunks)
    assert seen["direct"] > 0 and seen["sent"] > 0, seen


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
    port = free_port()
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


@contextlib.asynccontextmanager
async def _serving(listen: ListenConfig) -> AsyncIterator[None]:
    """`_ok` under HTTPServer with `listen`, until the block ends."""
    http = HTTPServer(_ok, listen, lifespan="off", graceful_shutdown=1)
    serving = asyncio.create_task(http.serve())
    try:
        for _ in range(200):
            if http.started or serving.done():
                break
            await asyncio.sleep(0.02)
        assert http.started, "the server never listened"
        yield
    finally:
        http.stop()
        await asyncio.wait_for(serving, 10)


@pytest.mark.asyncio
async def test_a_key_guards_every_path_but_health_and_metrics() -> None:
    """With keys set, a request outside /health and /metrics without one of them as a Bearer
    token is a 401 in OpenAI's error shape; either key opens every path (vLLM's --api-key)."""
    port = free_port()
    listen = ListenConfig(host="127.0.0.1", port=port, api_keys=("key-one", "key-two"))
    url = f"http://127.0.0.1:{port}"
    async with _serving(listen), httpx.AsyncClient(base_url=url) as client:
        for path in ("/health", "/metrics", "/health/"):
            assert (await client.get(path)).status_code == 200, path
        refused = ("", "Bearer wrong", "key-one", "Basic key-one", "Bearer key", "Bearer  key-one")
        for value in refused:
            headers = {"Authorization": value} if value else {}
            for path in ("/v1/models", "/v1/completions", "/tokenize", "/engines", "/"):
                r = await client.post(path, headers=headers, content=b"{}")
                assert r.status_code == 401, (path, headers)
                assert r.headers["www-authenticate"] == "Bearer"
                error = r.json()["error"]
                assert r.json()["object"] == "error"
                assert (error["type"], error["code"]) == ("AuthenticationError", 401)
        for key in ("key-one", "key-two"):
            for scheme in ("Bearer", "bearer"):
                r = await client.get("/v1/models", headers={"Authorization": f"{scheme} {key}"})
                assert (r.status_code, r.text) == (200, "ok")


@pytest.mark.asyncio
async def test_no_key_no_check() -> None:
    """Without keys every path is open, as before."""
    port = free_port()
    async with _serving(ListenConfig(host="127.0.0.1", port=port)), httpx.AsyncClient() as client:
        r = await client.post(f"http://127.0.0.1:{port}/v1/completions", content=b"{}")
        assert r.status_code == 200


def test_the_key_comes_from_the_flag_else_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--api-key wins (several keys allowed); without it $BATON_API_KEY; an empty one is none."""
    parser = argparse.ArgumentParser()
    add_listen_args(parser, ListenConfig)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_keys_from_args(parser.parse_args([])) == ()
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert api_keys_from_args(parser.parse_args([])) == ("from-env",)
    flags = parser.parse_args(["--api-key", "a", "b"])
    assert api_keys_from_args(flags) == ("a", "b")
    monkeypatch.setenv(API_KEY_ENV, "")
    assert api_keys_from_args(parser.parse_args([])) == ()


@pytest.mark.asyncio
async def test_tls_with_the_ssl_flags(tmp_path: Path) -> None:
    """--ssl-certfile/--ssl-keyfile serve HTTPS: a client trusting the CA gets its answer, one
    that does not is refused, and plain HTTP gets no answer."""
    certs = make_certs(tmp_path)
    port = free_port()
    listen = ListenConfig(host="127.0.0.1", port=port, ssl_certfile=str(certs.cert),
                          ssl_keyfile=str(certs.key), api_keys=("k",))  # fmt: skip
    async with _serving(listen):
        trusted = ssl.create_default_context(cafile=str(certs.ca))
        async with httpx.AsyncClient(verify=trusted) as client:
            r = await client.get(f"https://127.0.0.1:{port}/v1/models",
                                 headers={"Authorization": "Bearer k"})  # fmt: skip
            assert (r.status_code, r.text) == (200, "ok")
            assert (await client.get(f"https://127.0.0.1:{port}/v1/models")).status_code == 401
        async with httpx.AsyncClient() as untrusting:
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await untrusting.get(f"https://127.0.0.1:{port}/health")
        async with httpx.AsyncClient() as plain:
            with pytest.raises(httpx.HTTPError):
                await plain.get(f"http://127.0.0.1:{port}/health")


@pytest.mark.asyncio
@pytest.mark.parametrize("idle_for", [0.0, 0.4])
async def test_a_tls_server_with_an_idle_client_stops_at_once(
    tmp_path: Path, idle_for: float
) -> None:
    """A pooled keep-alive connection over TLS does not hold a stop: the server sends its
    close_notify and closes without waiting for the client's, which a client that is not
    reading never sends (the event loop would wait 30 s for it). Also for a connection the
    keep-alive timeout closed just before the stop (`idle_for` past uvicorn's 0.3 s here)."""
    certs = make_certs(tmp_path)
    port = free_port()
    listen = ListenConfig(host="127.0.0.1", port=port, ssl_certfile=str(certs.cert),
                          ssl_keyfile=str(certs.key))  # fmt: skip
    http = HTTPServer(_ok, listen, lifespan="off", graceful_shutdown=20)
    http._uvicorn.config.timeout_keep_alive = 0.3  # type: ignore[assignment]
    serving = asyncio.create_task(http.serve())
    for _ in range(200):
        if http.started or serving.done():
            break
        await asyncio.sleep(0.02)
    assert http.started, "the server never listened"
    trusted = ssl.create_default_context(cafile=str(certs.ca))
    async with httpx.AsyncClient(verify=trusted) as client:
        assert (await client.get(f"https://127.0.0.1:{port}/")).text == "ok"
        await asyncio.sleep(idle_for)  # the connection waits in the client's pool, unread
        started = asyncio.get_running_loop().time()
        http.stop()
        await asyncio.wait_for(serving, 10)
        assert asyncio.get_running_loop().time() - started < 2
        with pytest.raises(httpx.HTTPError):  # the pooled connection is gone, and the server
            await client.get(f"https://127.0.0.1:{port}/")


def test_the_startup_heap_is_frozen_out_of_the_collectors_reach() -> None:
    """What exists when a server starts (here: a cycle made before) is moved out of the
    collector's generations, so a full pass no longer walks it; what comes after is collected
    as before."""

    class Node:
        other: Node

    def cycle() -> Node:
        a, b = Node(), Node()
        a.other, b.other = b, a
        return a

    kept = cycle()
    assert gc.get_freeze_count() == 0
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # out of every generation
        later = cycle()
        assert any(o is later for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())
