"""Scale to zero on the router's side: requests for a model with no engine up are held, go on in
arrival order once discovery (against the emulated API server) brings an engine and it passes
its health check, and are answered 503 with Retry-After when their time runs out, their queue is
full or the router stops; the held-requests gauge and the outcomes are counted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from baton.errors import APIError
from baton.router.app import build_app
from baton.router.discovery import Endpoint
from baton.router.k8s_discovery import KubernetesDiscovery
from baton.router.router import Router
from tests.router.harness import FAST, FakeCluster, RouterServer
from tests.router.test_k8s_discovery import SLICES, publish, service
from tests.support.kmock_server import ApiServer, endpoint_slice
from tests.support.ports import free_port
from tests.support.router_process import RouterProcess
from tests.support.thread_server import ThreadServer, scrape

HELD = "baton:router_held_requests"
OUTCOMES = "baton:router_hold_outcomes_total"


def wait_until(check: Callable[[], bool], what: str, timeout: float = 10) -> None:
    """Until `check()` holds; fails naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def wait_held(url: str, model: str, count: int) -> None:
    """Until the router at `url` holds `count` requests for `model`, by its gauge."""
    wait_until(lambda: scrape(url, HELD, model=model) == count, f"{count} held for {model}")


def post(url: str, body: dict[str, Any], timeout: float = 30) -> httpx.Response:
    """A completion request; a stream's events are read whole."""
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def completion(model: str, prompt: str, stream: bool = False) -> dict[str, Any]:
    """A completions body of two tokens."""
    return {"model": model, "prompt": prompt, "max_tokens": 2, "stream": stream}


def assert_retry_later(response: httpx.Response, retry_after: str, says: str) -> None:
    """A 503 in OpenAI's error shape, with Retry-After."""
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == retry_after
    error = response.json()["error"]
    assert error["type"] == "ServiceUnavailable" and says in error["message"], error


def held_gauge_line(url: str, model: str) -> str | None:
    """The held-requests sample of `model` as /metrics writes it (None: absent)."""
    prefix = f'{HELD}{{model="{model}"}} '
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return next((line for line in text.splitlines() if line.startswith(prefix)), None)


def wait_serving(proc: RouterProcess) -> None:
    """Until the router process answers /health 200 (its engines checked once)."""
    deadline = time.monotonic() + 30
    while True:
        assert proc.proc.poll() is None, proc.log()
        try:
            if httpx.get(f"{proc.url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, proc.log()
        time.sleep(0.1)


def test_held_requests_go_on_in_order_when_discovery_brings_an_engine(
    api: tuple[ApiServer, str], cluster: FakeCluster
) -> None:
    """A pool at zero (its Service and an empty EndpointSlice, the model given by
    --served-model): requests are held, the gauge goes 0 -> N, and when the pod becomes a ready
    endpoint the engine gets them in arrival order and the gauge is 0 again. One upstream
    connection, so that the engine sees requests in the order the router sends them."""
    server, kubeconfig = api
    svc = service("serving", "llama", "both", "llama")
    publish(server, svc, {})
    engine, engine_server = cluster.add("both", "llama")
    router = Router(replace(FAST, served_models=("llama",), max_connections=1))
    discovery = KubernetesDiscovery(
        "serving", {"baton.dev/inference-service": "llama"}, kubeconfig=kubeconfig
    )
    http = ThreadServer(build_app(router, discovery), lifespan="on").start()
    url = http.url
    try:
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, "discovery")
        assert held_gauge_line(url, "llama") == f'{HELD}{{model="llama"}} 0.0'
        n = 5
        with ThreadPoolExecutor(n) as pool:
            answers: list[Future[httpx.Response]] = []
            for i in range(n):
                answers.append(pool.submit(post, url, completion("llama", f"prompt {i}")))
                wait_held(url, "llama", i + 1)  # each arrives before the next is sent
            assert not engine.requests
            ready = endpoint_slice(svc, {"127.0.0.1": True}, port=engine_server.port)
            path = SLICES.format(ns="serving") + "/" + ready["metadata"]["name"]
            headers = {"Content-Type": "application/merge-patch+json"} | server.headers()
            patch = {"ports": ready["ports"], "endpoints": ready["endpoints"]}
            assert httpx.patch(server.url + path, json=patch, headers=headers).is_success
            responses = [a.result(timeout=10) for a in answers]
        assert [r.status_code for r in responses] == [200] * n, responses[0].text
        assert [r["prompt"] for r in engine.requests] == [f"prompt {i}" for i in range(n)]
        assert scrape(url, HELD, model="llama") == 0
        assert scrape(url, OUTCOMES, model="llama", outcome="released") == n
        assert scrape(url, "baton:router_hold_seconds_count") == n
    finally:
        http.server.should_exit = True
        http.thread.join(10)


def test_held_requests_time_out_with_retry_after() -> None:
    """With no engine coming, held requests (streamed or not) get 503 + Retry-After after
    --hold-timeout and count as timed_out; a --served-model never seen shows a gauge of 0, an
    unknown model stays a 404, and --hold-timeout 0 answers 503 at once as before."""
    router = RouterServer([], replace(FAST, served_models=("m",), hold_timeout=0.5))
    router.start()
    try:
        router.wait_ready()
        assert held_gauge_line(router.url, "m") == f'{HELD}{{model="m"}} 0.0'
        assert post(router.url, completion("other", "x")).status_code == 404
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            answers = [
                pool.submit(post, router.url, completion("m", "x", s)) for s in (False, True)
            ]
            responses = [a.result(timeout=10) for a in answers]
        assert 0.5 <= time.monotonic() - started < 3
        for response in responses:
            assert_retry_later(response, "5", "came up in 0.5 s")
        assert router.metric(OUTCOMES, model="m", outcome="timed_out") == 2
        assert router.metric("baton:router_hold_seconds_count") == 2
        assert router.metric(HELD, model="m") == 0
    finally:
        router.stop()
    off = RouterServer([], replace(FAST, served_models=("m",), hold_timeout=0))
    off.start()
    try:
        off.wait_ready()
        started = time.monotonic()
        response = post(off.url, completion("m", "x"))
        assert response.status_code == 503 and time.monotonic() - started < 1
        assert "retry-after" not in response.headers
    finally:
        off.stop()


def test_a_full_queue_refuses_at_once_and_clients_that_leave_are_dropped() -> None:
    """Past --hold-queue-size a request gets 503 + Retry-After at once (rejected); held clients
    that give up leave the queue (abandoned), so the gauge returns to 0."""
    router = RouterServer([], replace(FAST, served_models=("m",), hold_queue_size=2))
    router.start()
    try:
        router.wait_ready()
        with ThreadPoolExecutor(2) as pool:
            leaving = [pool.submit(post, router.url, completion("m", "x"), 1.5) for _ in "ab"]
            wait_held(router.url, "m", 2)
            started = time.monotonic()
            refused = post(router.url, completion("m", "x"))
            assert time.monotonic() - started < 1
            assert_retry_later(refused, "5", "2 requests already wait")
            for gone in leaving:
                with pytest.raises(httpx.ReadTimeout):
                    gone.result(timeout=10)
        wait_held(router.url, "m", 0)
        assert router.metric(OUTCOMES, model="m", outcome="rejected") == 1
        wait_until(
            lambda: router.metric(OUTCOMES, model="m", outcome="abandoned") == 2, "abandoned"
        )
    finally:
        router.stop()


def test_sigterm_answers_held_requests_at_once(tmp_path: Path) -> None:
    """`baton router` holding requests (its only engine is down) answers every one 503 +
    Retry-After as soon as it gets SIGTERM, then exits 0: no client hangs through the drain."""
    dead = f"http://127.0.0.1:{free_port()}"
    proc = RouterProcess(tmp_path / "router.log", [], [dead], "--served-model", "m")
    try:
        wait_serving(proc)
        with ThreadPoolExecutor(3) as pool:
            answers = [
                pool.submit(post, proc.url, completion("m", "x", s)) for s in (False, True, False)
            ]
            wait_held(proc.url, "m", 3)
            started = time.monotonic()
            proc.proc.terminate()
            responses = [a.result(timeout=10) for a in answers]
        assert time.monotonic() - started < 3, proc.log()
        for response in responses:
            assert_retry_later(response, "1", "stopping")
        assert proc.proc.wait(10) == 0, proc.log()
        assert time.monotonic() - started < 8, proc.log()  # not the 30 s drain
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait(5)


def test_decode_at_zero_holds_and_prefill_at_zero_serves(cluster: FakeCluster) -> None:
    """Decode pool at zero with a prefill engine up: requests are held (only decode answers),
    then handed off once a decode engine comes up. Prefill pool at zero with decode up: no hold,
    --on-no-prefill decides (here: decode alone)."""
    prefill, _ = cluster.add("prefill")
    decode, _ = cluster.add("decode")
    decode.healthy = False
    router = RouterServer(cluster.endpoints(), replace(FAST, on_no_prefill="decode"))
    router.start()
    try:
        router.wait_ready(available=1)
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(post, router.url, completion("fake", "x", stream=True))
            wait_held(router.url, "fake", 1)
            assert not prefill.requests
            decode.healthy = True
            response = held.result(timeout=10)
        assert response.status_code == 200 and "[DONE]" in response.text, response.text
        assert decode.remote_decodes == 1  # the hand-off ran
        prefill.healthy = False
        router.wait_ready(available=1)
        started = time.monotonic()
        response = post(router.url, completion("fake", "y"))
        assert response.status_code == 200 and time.monotonic() - started < 1
        assert router.metric(OUTCOMES, model="fake", outcome="released") == 1
        outcome = "decode_only_fallback"
        assert router.metric("baton:router_disagg_decisions_total", outcome=outcome) == 1
    finally:
        router.stop()


def test_models_shown_by_discovery_stay_known() -> None:
    """A model discovery showed stays served (held for, listed) after its engines are gone;
    one never seen is still unknown."""

    async def main() -> None:
        router = Router(FAST)
        try:
            router.on_discovery(frozenset({Endpoint("http://127.0.0.1:1", "both", "seen")}))
            router.on_discovery(frozenset())
            assert router.resolve_model("seen") == "seen"
            assert [c["id"] for c in router.models()["data"]] == ["seen"]
            with pytest.raises(APIError) as unknown:
                router.resolve_model("never")
            assert unknown.value.status == 404
        finally:
            await router.close()

    asyncio.run(main())
