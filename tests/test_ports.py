"""The port picker of `baton serve`, the tensor-parallel rendezvous and the tests' stacks: below
the kernel's ephemeral range, free when picked, never handed out twice."""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from threading import Thread

import httpx
import pytest

from baton import ports
from tests.support import engine_server, router_process
from tests.support.procs import listens


def test_picks_free_ports_below_the_ephemeral_range_and_never_twice() -> None:
    start = ports._ephemeral_start()
    picked = [ports.free_port() for _ in range(300)]
    assert len(set(picked)) == len(picked)
    if start - ports._LOWEST >= 1000:
        assert all(ports._LOWEST <= p < start for p in picked)
    for port in picked[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when handed out


def test_a_seeded_random_does_not_repeat_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Test runners seed `random` alike in every worker; the picker does not draw from it: three
    fresh processes' first picks (each after the same seed) are not all the same port."""
    firsts = []
    for _ in range(3):
        monkeypatch.setattr(ports, "_given", set())
        random.seed(1)
        firsts.append(ports.free_port())
    assert len(set(firsts)) > 1


def test_falls_back_to_the_kernels_pick_without_room(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: ports._LOWEST + 10)
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@contextlib.contextmanager
def _squatter() -> Iterator[int]:
    """An HTTP server on a port of its own that answers /health as a ready engine or router
    would (200, no engine available); its port."""

    class Healthy(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"status": "ok", "available": 0}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    squatter = HTTPServer(("127.0.0.1", 0), Healthy)
    Thread(target=squatter.serve_forever, daemon=True).start()
    try:
        yield squatter.server_address[1]
    finally:
        squatter.shutdown()
        squatter.server_close()


def test_an_engine_whose_port_another_server_took_starts_again_on_another(
    tiny_model, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port is named before the server binds it, so another process may take the number
    first (CI saw a test's engine answered by another test's, on its port). The test servers
    take a ready answer only from their own socket (`procs.listens`) and start again on
    another port when theirs was taken."""
    with _squatter() as taken:
        picks = iter([taken])
        monkeypatch.setattr(
            engine_server, "free_port", lambda: next(picks, None) or ports.free_port()
        )
        server = engine_server.start_server(tiny_model("llama"), tmp_path)
        try:
            assert server.port != taken and listens(server.proc.pid, server.port)
            assert not listens(server.proc.pid, taken)
            assert "address already in use" in server.log()  # the first start's
            assert server.client().models.list().data[0].id == engine_server.NAME
        finally:
            server.stop()


def test_a_router_whose_port_another_server_took_starts_again_on_another(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for the tests' `baton router` processes."""
    with _squatter() as taken:
        picks = iter([taken])
        monkeypatch.setattr(
            router_process, "free_port", lambda: next(picks, None) or ports.free_port()
        )
        # An engine that is not there: the router is ready with none available.
        dead = f"http://127.0.0.1:{ports.free_port()}"
        router = router_process.RouterProcess(tmp_path / "router.log", [], [dead])
        try:
            router.expected = 0
            router.wait_ready()
            assert router.port != taken and listens(router.proc.pid, router.port)
            assert "address already in use" in router.log()
            assert httpx.get(f"{router.url}/engines").status_code == 200
        finally:
            router.stop()
