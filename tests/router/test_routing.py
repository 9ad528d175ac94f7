"""The router in front of fake engines: OpenAI routes, models, streaming pass-through, errors,
retries, backpressure and prefix-aware placement."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from baton.router.app import build_app
from baton.router.config import RouterConfig
from baton.router.router import Router
from tests.router.harness import FakeCluster, routed
from tests.support.fake_engine import token_text


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["object"] == "error" and body["error"]["code"] == status
    return str(body["error"]["message"])


def test_completion_and_chat_equal_the_engines_answers(cluster: FakeCluster) -> None:
    """Completions and chat completions through the router equal the engine's own answers."""
    _, engine_server = cluster.add()
    with routed(cluster) as router:
        direct, via = _client(engine_server.url), _client(router.url)
        a = direct.completions.create(model="fake", prompt="hello", max_tokens=5)
        b = via.completions.create(model="fake", prompt="hello", max_tokens=5)
        assert b.choices[0].text == a.choices[0].text and len(b.choices[0].text.split()) == 5
        messages: Any = [{"role": "user", "content": "hi"}]
        c = direct.chat.completions.create(model="fake", messages=messages, max_tokens=3)
        d = via.chat.completions.create(model="fake", messages=messages, max_tokens=3)
        assert d.choices[0].message.content == c.choices[0].message.content


def test_streaming_passes_chunks_through_as_they_come(cluster: FakeCluster) -> None:
    """A stream's first chunk reaches the client long before the engine's last one is made."""
    engine, _ = cluster.add()
    engine.itl = 0.15
    with routed(cluster) as router:
        stream = _client(router.url).completions.create(
            model="fake",
            prompt="p",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        start = time.monotonic()
        arrivals, texts, usage = [], [], None
        for chunk in stream:
            arrivals.append(time.monotonic() - start)
            if chunk.choices:
                texts.append(chunk.choices[0].text)
            usage = chunk.usage or usage
        assert arrivals[0] < 0.3 and arrivals[-1] > 0.4  # the engine sends its last at 0.45 s
        key_texts = "".join(texts)
        assert key_texts.count(" t") == 4 and usage is not None and usage.completion_tokens == 4


def test_models_are_listed_and_requests_routed_by_model(cluster: FakeCluster) -> None:
    """/v1/models lists every model; a request goes only to engines of the model it names."""
    a, _ = cluster.add(model="alpha")
    b, _ = cluster.add(model="beta")
    with routed(cluster) as router:
        listed = httpx.get(f"{router.url}/v1/models").json()
        assert [m["id"] for m in listed["data"]] == ["alpha", "beta"]
        assert listed["data"][0]["root"] == "/alpha"
        client = _client(router.url)
        for _ in range(3):
            client.completions.create(model="beta", prompt="x", max_tokens=1)
        assert len(a.requests) == 0 and len(b.requests) == 3
        unknown = httpx.post(f"{router.url}/v1/completions", json={"model": "gamma", "prompt": "x"})
        assert "gamma" in _error(unknown, 404)
        unnamed = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"})
        assert "model is required" in _error(unnamed, 400)
        bad = httpx.post(
            f"{router.url}/v1/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert "not valid JSON" in _error(bad, 400)


def test_single_model_needs_no_model_field(cluster: FakeCluster) -> None:
    """With one model served, a request without `model` goes to it."""
    engine, _ = cluster.add()
    with routed(cluster) as router:
        r = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and len(engine.requests) == 1


def test_failed_engine_is_retried_elsewhere_before_the_first_byte(cluster: FakeCluster) -> None:
    """An engine answering 503 is skipped: every request succeeds on the other, counted as a
    retry, and the failing engine is ejected after consecutive failures."""
    bad, _ = cluster.add()
    good, _ = cluster.add()
    bad.fail_status = 503
    with routed(cluster, eject_seconds=30) as router:  # no return to rotation mid-test
        client = _client(router.url)
        for _ in range(6):
            assert client.completions.create(model="fake", prompt="x", max_tokens=1).choices
        assert len(good.requests) == 6 and 1 <= len(bad.requests) <= 2
        assert router.metric("baton:router_retries_total") == len(bad.requests)
        assert router.metric("baton:router_ejections_total") >= 1


def test_every_engine_pushing_back_gives_429(cluster: FakeCluster) -> None:
    """When one engine answers 429 the other serves; when all do, the router answers 429."""
    a, _ = cluster.add()
    b, _ = cluster.add()
    a.fail_status = 429
    with routed(cluster) as router:
        body = {"model": "fake", "prompt": "x", "max_tokens": 1}
        for _ in range(4):
            assert httpx.post(f"{router.url}/v1/completions", json=body).status_code == 200
        b.fail_status = 429
        message = _error(httpx.post(f"{router.url}/v1/completions", json=body), 429)
        assert "429" in message
        assert router.metric("baton:router_requests_total", code="429") == 1
        # backpressure is not a failure: nobody was ejected
        assert router.metric("baton:router_ejections_total") == 0


def test_no_available_engine_gives_503(cluster: FakeCluster) -> None:
    """With the model's only engine failing its health check and holding off (--hold-timeout 0;
    held requests: test_hold.py), requests get a clear 503 at once."""
    engine, _ = cluster.add()
    with routed(cluster, hold_timeout=0) as router:
        engine.healthy = False
        router.wait_ready(available=0)
        r = httpx.post(f"{router.url}/v1/completions", json={"model": "fake", "prompt": "x"})
        assert "no healthy engine" in _error(r, 503)
        assert len(engine.requests) == 0


def test_a_stream_that_breaks_ends_with_an_error_event(cluster: FakeCluster) -> None:
    """An engine whose stream dies after its first chunk: the client gets the chunk, an error
    event and [DONE], never a hang."""
    engine, _ = cluster.add()
    engine.break_after_chunks = 1
    with routed(cluster) as router:
        body = {"model": "fake", "prompt": "x", "max_tokens": 5, "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=5) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert len(events) == 3 and events[-1] == "data: [DONE]"
        assert json.loads(events[0][6:])["choices"][0]["text"].startswith(" t")
        assert json.loads(events[1][6:])["error"]["code"] == 502
        assert router.metric("baton:router_upstream_errors_total", kind="stream") == 1


@pytest.mark.parametrize("direct_writes", [True, False])
def test_a_slow_client_gets_a_long_stream_whole(cluster: FakeCluster, direct_writes: bool) -> None:
    """A 24 MiB stream to a client that reads nothing for a second: the router stops reading
    the engine while the client's connection is full, then every event arrives once and in
    order. Served as `baton router` serves (chunks written past `send`) and with every chunk
    through `send`."""
    engine, _ = cluster.add()
    engine.token_padding = 8192
    pad = " " * engine.token_padding
    with routed(cluster, direct_writes=direct_writes) as router:

        async def read_slowly() -> list[str]:
            async with httpx.AsyncClient(timeout=30) as client:
                body = {"model": "fake", "prompt": "slow", "max_tokens": 3000, "stream": True}
                async with client.stream("POST", f"{router.url}/v1/completions", json=body) as r:
                    await asyncio.sleep(1.0)
                    return [line async for line in r.aiter_lines() if line.startswith("data: ")]

        lines = asyncio.run(read_slowly())
    assert lines[-1] == "data: [DONE]"
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]]
    assert len(texts) == 3000 and all(t.endswith(pad) for t in texts)
    first = int(texts[0].split()[0][1:])  # " t<n>": the engine's tokens, each once, in order
    assert texts == [token_text(first, i) + pad for i in range(3000)]


def test_an_unknown_path_or_method_is_an_openai_error() -> None:
    """No route for the path is a 404, none for the method a 405 with `Allow`, both in
    OpenAI's error shape, as every other error of the router."""
    with TestClient(build_app(Router(RouterConfig()))) as client:
        missing = client.post("/v1/nothing", json={})
        wrong = client.get("/v1/completions")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405
    assert wrong.json()["error"]["type"] == "MethodNotAllowed"
    assert "POST" in wrong.headers["allow"]


def test_a_client_that_leaves_closes_the_engine_stream(cluster: FakeCluster) -> None:
    """A streaming client that disconnects: the router closes its engine stream (the engine
    sees the disconnect and stops) and its in-flight count returns to zero."""
    engine, _ = cluster.add()
    engine.itl = 0.05
    with routed(cluster) as router:

        async def leave_early() -> None:
            async with httpx.AsyncClient(timeout=5) as client:
                body = {"model": "fake", "prompt": "x", "max_tokens": 1000, "stream": True}
                async with client.stream("POST", f"{router.url}/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        break

        asyncio.run(leave_early())
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (
            engine.in_flight or router.metric("baton:router_in_flight")
        ):
            time.sleep(0.05)
        assert engine.in_flight == 0 and engine.disconnects == 1
        assert router.metric("baton:router_in_flight") == 0


def test_a_client_that_leaves_a_whole_answer_early_is_let_go(cluster: FakeCluster) -> None:
    """A non-streaming client that gives up: the router drops the engine request at once (the
    engine sees the disconnect, the in-flight count drops) and logs the request as 499."""
    engine, _ = cluster.add()
    engine.ttft = 3.0
    with routed(cluster) as router:
        body = {"model": "fake", "prompt": "x", "max_tokens": 1}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{router.url}/v1/completions", json=body, timeout=0.3)
        deadline = time.monotonic() + 2
        while router.metric("baton:router_requests_total", code="499") == 0:
            assert time.monotonic() < deadline, "the router kept waiting for the engine"
            time.sleep(0.05)
        assert router.metric("baton:router_in_flight") == 0
        deadline = time.monotonic() + 2
        while engine.disconnects == 0:
            assert time.monotonic() < deadline, "the engine request was left open"
            time.sleep(0.05)


def test_tokenize_and_detokenize_are_forwarded(cluster: FakeCluster) -> None:
    """/tokenize and /detokenize reach an engine of the model and come back unchanged."""
    cluster.add()
    with routed(cluster) as router:
        t = httpx.post(f"{router.url}/tokenize", json={"model": "fake", "prompt": "ab"})
        assert t.json()["tokens"] == [97, 98]
        d = httpx.post(f"{router.url}/detokenize", json={"model": "fake", "tokens": [97, 98]})
        assert d.json()["prompt"] == "ab"


@pytest.mark.parametrize("stream", [False, True])
def test_router_metrics_count_requests_by_route(cluster: FakeCluster, stream: bool) -> None:
    """Each answered request is counted by route and status, with its latency observed."""
    cluster.add()
    with routed(cluster) as router:
        body = {"model": "fake", "prompt": "x", "max_tokens": 2, "stream": stream}
        for _ in range(3):
            httpx.post(f"{router.url}/v1/completions", json=body).raise_for_status()
        route = "/v1/completions"
        assert router.metric("baton:router_requests_total", route=route, code="200") == 3
        count = "baton:router_request_duration_seconds_count"
        assert router.metric(count, route=route) == 3


def test_prefix_aware_routing_keeps_families_together(cluster: FakeCluster) -> None:
    """Under the default prefix-aware policy, prompts sharing a system prompt go to the engine
    that served it first, and new system prompts spread over the engines."""
    for _ in range(4):
        cluster.add()
    placed: dict[int, str] = {}
    with routed(cluster) as router:
        for user in range(3):
            # A shuffled order, so round-robin (or any fixed rotation) does not pass by chance.
            for family in random.Random(user).sample(range(8), 8):
                body = {"model": "fake", "prompt": f"system {family} " * 30 + f"user {user}"}
                r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=10)
                assert r.status_code == 200, r.text
                engine = r.headers["x-baton-engine"]
                assert placed.setdefault(family, engine) == engine, (family, user)
    assert sorted(Counter(placed.values()).values()) == [2, 2, 2, 2]
