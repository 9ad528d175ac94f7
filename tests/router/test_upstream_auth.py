"""What the router shows engines: its upstream key on every request (generation, the hand-off's
two steps, /tokenize, health checks) and never the client's Authorization header."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from baton.http_server import BearerAuth
from baton.router.discovery import Endpoint
from baton.router.upstream_auth import UpstreamAuth
from tests.router.harness import FAST, RouterServer
from tests.support.fake_engine import FakeEngine, LeaseBoard
from tests.support.thread_server import ThreadServer

CLIENT = {"Authorization": "Bearer the-routers-own-key"}


class Seen:
    """An ASGI wrapper that notes the Authorization header of each request, by path."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.auth: dict[str, set[str | None]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            value = dict(scope["headers"]).get(b"authorization")
            seen = self.auth.setdefault(scope["path"], set())
            seen.add(value.decode() if value is not None else None)
        await self.app(scope, receive, send)


@pytest.fixture
def engines(request: pytest.FixtureRequest) -> Iterator[list[tuple[Seen, ThreadServer]]]:
    """A prefill and a decode fake engine that require `request.param` as their key (None:
    no key), each wrapped in `Seen`."""
    key: str | None = getattr(request, "param", None)
    board = LeaseBoard()
    started = []
    try:
        for role in ("prefill", "decode"):
            engine = FakeEngine("fake", role, board)  # type: ignore[arg-type]
            app: ASGIApp = BearerAuth(engine.app, (key,)) if key else engine.app
            seen = Seen(app)
            server = ThreadServer(seen).start()
            engine.port = server.port
            started.append((seen, server))
        yield started
    finally:
        for _, server in started:
            server.stop()


def _exercise(router: RouterServer) -> None:
    """A completion through the hand-off, a streamed chat one, and /tokenize."""
    body = {"model": "fake", "prompt": "hello there", "max_tokens": 3}
    r = httpx.post(f"{router.url}/v1/completions", json=body, headers=CLIENT, timeout=10)
    assert r.status_code == 200, r.text
    chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    r = httpx.post(f"{router.url}/v1/chat/completions", json=chat, headers=CLIENT, timeout=10)
    assert r.status_code == 200 and "[DONE]" in r.text, r.text
    r = httpx.post(f"{router.url}/tokenize", json={"model": "fake", "prompt": "x"}, headers=CLIENT)
    assert r.status_code == 200, r.text


def _router(engines: list[tuple[Seen, ThreadServer]], **config: object) -> RouterServer:
    roles = ("prefill", "decode")
    endpoints = [Endpoint(s.url, role) for (_, s), role in zip(engines, roles, strict=True)]
    router = RouterServer(endpoints, replace(FAST, **config))  # type: ignore[arg-type]
    router.start()
    return router


@pytest.mark.parametrize("engines", ["engine-key"], indirect=True)
def test_every_request_to_an_engine_carries_the_upstream_key(
    engines: list[tuple[Seen, ThreadServer]],
) -> None:
    """With --upstream-api-key, engines that require it serve the router on every path, and
    see that key only: never the client's header."""
    router = _router(engines, upstream_api_key="engine-key")
    try:
        router.wait_ready(available=2)
        _exercise(router)
    finally:
        router.stop()
    paths = set()
    for seen, _ in engines:
        paths |= set(seen.auth)
        assert all(values == {"Bearer engine-key"} for values in seen.auth.values()), seen.auth
    assert {"/health", "/v1/models", "/metrics", "/v1/completions"} <= paths
    assert {"/v1/chat/completions", "/tokenize"} <= paths


def test_without_an_upstream_key_no_authorization_reaches_the_engines(
    engines: list[tuple[Seen, ThreadServer]],
) -> None:
    """The client's Authorization header is for the router: without an upstream key the
    engines get none at all."""
    router = _router(engines)
    try:
        router.wait_ready(available=2)
        _exercise(router)
    finally:
        router.stop()
    for seen, _ in engines:
        assert seen.auth and all(values == {None} for values in seen.auth.values()), seen.auth


@pytest.mark.parametrize("engines", ["engine-key"], indirect=True)
def test_engines_refusing_the_upstream_key_stay_out_of_rotation(
    engines: list[tuple[Seen, ThreadServer]],
) -> None:
    """A wrong upstream key: /v1/models answers 401, so the engines never come into rotation
    (their models unknown, a client gets 404)."""
    router = _router(engines, upstream_api_key="stale-key")
    try:
        router.wait_ready(available=0)
        engines_seen = httpx.get(f"{router.url}/engines").json()["engines"]
        assert [e["available"] for e in engines_seen] == [False, False]
        body = {"model": "fake", "prompt": "hello", "max_tokens": 3}
        r = httpx.post(f"{router.url}/v1/completions", json=body, headers=CLIENT, timeout=10)
        assert r.status_code == 404, r.text  # no model known: /v1/models never answered
    finally:
        router.stop()


def test_the_client_header_is_replaced_not_merged() -> None:
    """`UpstreamAuth.apply` drops the client's header; without a key the dict passes as is."""
    from baton.router.config import RouterConfig

    with_key = UpstreamAuth(RouterConfig(upstream_api_key="k"))
    headers = {"content-type": "application/json", "authorization": "Bearer client"}
    assert with_key.apply(headers) == {"content-type": "application/json",
                                       "authorization": "Bearer k"}  # fmt: skip
    without = UpstreamAuth(RouterConfig())
    assert without.apply(headers) == {"content-type": "application/json"}
    plain = {"content-type": "application/json"}
    assert without.apply(plain) is plain
    with pytest.raises(ValueError, match="upstream_api_key"):
        RouterConfig(upstream_api_key="")
    assert "secret-k" not in repr(RouterConfig(upstream_api_key="secret-k"))
