"""Keys and TLS end to end: a real engine that requires its key over HTTPS, and `baton router`
(a process) that requires its own key over HTTPS and holds the engine's as its upstream key,
with the `openai` client in front."""

from __future__ import annotations

import contextlib
import os
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from baton.http_server import API_KEY_ENV
from baton.router.cli import UPSTREAM_API_KEY_ENV
from tests.support.engine_server import NAME, Server
from tests.support.router_process import RouterProcess
from tests.support.tls import Certs, make_certs

pytestmark = pytest.mark.slow

ENGINE_KEY = "engine-key-for-the-router-only"
ROUTER_KEY = "the-clients-key"


class TLSServer(Server):
    """The engine server on HTTPS, checked through the test CA."""

    scheme = "https"

    def __init__(self, model: Path, log: Path, certs: Certs, *flags: str) -> None:
        self.verify = ssl.create_default_context(cafile=str(certs.ca))
        super().__init__(model, log, "--ssl-certfile", str(certs.cert),
                         "--ssl-keyfile", str(certs.key), *flags)  # fmt: skip

    def _health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", verify=self.verify, timeout=1)


class TLSRouter(RouterProcess):
    """`baton router` on HTTPS in front of aggregated engine URLs."""

    scheme = "https"

    def __init__(self, log: Path, certs: Certs, engines: list[str], *flags: str) -> None:
        self.verify = ssl.create_default_context(cafile=str(certs.ca))
        urls = [w for u in engines for w in ("--engine", u)]
        super().__init__(log, [], [], "--ssl-certfile", str(certs.cert),
                         "--ssl-keyfile", str(certs.key), *urls, *flags)  # fmt: skip
        self.expected = len(engines)

    def _health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", verify=self.verify, timeout=1)

    def client(self, key: str | None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0,
                             http_client=httpx.Client(verify=self.verify))  # fmt: skip


@dataclass
class Stack:
    engine: TLSServer
    router: TLSRouter


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """`values` in os.environ inside the block (the child processes started there inherit
    them), the old ones back after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The engine takes its key by flag; the router both of its keys from the environment
    (as the operator mounts them), and verifies the engine's certificate with the test CA."""
    tmp = tmp_path_factory.mktemp("auth-tls")
    certs = make_certs(tmp)
    engine = TLSServer(Path(tiny_model("llama")), tmp / "engine.log", certs,
                       "--api-key", "an-old-key", ENGINE_KEY)  # fmt: skip
    router: TLSRouter | None = None
    try:
        engine.wait_ready()
        with _env(**{API_KEY_ENV: ROUTER_KEY, UPSTREAM_API_KEY_ENV: ENGINE_KEY}):
            router = TLSRouter(tmp / "router.log", certs, [engine.url],
                               "--upstream-ca-certs", str(certs.ca))  # fmt: skip
        router.wait_ready()
        yield Stack(engine, router)
    finally:
        if router is not None:
            router.stop()
        engine.stop()


def test_the_openai_client_with_the_key_works_through_the_router(stack: Stack) -> None:
    """The client's key opens the router; the router's upstream key opens the engine, over
    HTTPS on both hops; completions, a chat stream and /v1/models all answer."""
    client = stack.router.client(ROUTER_KEY)
    assert [m.id for m in client.models.list().data] == [NAME]
    done = client.completions.create(model=NAME, prompt="The relay", max_tokens=4)
    assert done.usage is not None and done.usage.completion_tokens == 4
    stream = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    )
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content) >= 1


def test_a_missing_or_wrong_key_is_a_401(stack: Stack) -> None:
    """No key, a wrong one, and the engine's key (the router's clients never hold it) are each
    a 401 in OpenAI's error shape from the router; the router's key is a 401 at the engine."""
    for key in ("wrong", ENGINE_KEY):
        with pytest.raises(openai.AuthenticationError) as refused:
            stack.router.client(key).completions.create(model=NAME, prompt="x", max_tokens=1)
        assert refused.value.status_code == 401
    r = httpx.post(f"{stack.router.url}/v1/completions", verify=stack.router.verify,
                   json={"model": NAME, "prompt": "x", "max_tokens": 1})  # fmt: skip
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "AuthenticationError"
    engine = f"{stack.engine.url}/v1/completions"
    body = {"model": NAME, "prompt": "x", "max_tokens": 1}
    for key, status in ((ROUTER_KEY, 401), (ENGINE_KEY, 200), ("an-old-key", 200)):
        headers = {"Authorization": f"Bearer {key}"}
        r = httpx.post(engine, json=body, headers=headers, verify=stack.engine.verify)
        assert r.status_code == status, (key, r.text)


def test_health_and_metrics_stay_open(stack: Stack) -> None:
    """Probes and scrapers hold no key: /health and /metrics answer without one on both."""
    for url, verify in ((stack.router.url, stack.router.verify),
                        (stack.engine.url, stack.engine.verify)):  # fmt: skip
        assert httpx.get(f"{url}/health", verify=verify).status_code == 200
        metrics = httpx.get(f"{url}/metrics", verify=verify)
        assert metrics.status_code == 200 and "# TYPE" in metrics.text
        assert httpx.get(f"{url}/v1/models", verify=verify).status_code == 401
    assert httpx.get(f"{stack.router.url}/engines", verify=stack.router.verify).status_code == 401


def test_a_router_that_cannot_verify_the_engine_keeps_it_out(stack: Stack, tmp_path: Path) -> None:
    """Without --upstream-ca-certs the engine's certificate (from a private CA) fails the
    system's verification, so the engine never comes into rotation."""
    certs = make_certs(tmp_path)
    router = TLSRouter(tmp_path / "router.log", certs, [stack.engine.url],
                       "--upstream-api-key", ENGINE_KEY)  # fmt: skip
    try:
        router.expected = 0
        router.wait_ready()
        time.sleep(0.6)  # another health round
        engines = httpx.get(f"{router.url}/engines", verify=router.verify).json()["engines"]
        assert [e["healthy"] for e in engines] == [False]
        assert "CERTIFICATE_VERIFY_FAILED" in router.log() or "certificate" in router.log()
    finally:
        router.stop()
