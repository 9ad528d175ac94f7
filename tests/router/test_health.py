"""Engine health through a running router: active checks, passive ejection, recovery,
least-load from scraped metrics, and discovery changes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from baton.router.discovery import Endpoint
from baton.router.health import parse_load
from tests.router.harness import FakeCluster, RouterServer, routed
from tests.support.thread_server import ThreadServer

BODY = {"model": "fake", "prompt": "x", "max_tokens": 1}


def _eventually(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _engines(router: RouterServer) -> list[dict[str, Any]]:
    return list(httpx.get(f"{router.url}/engines").json()["engines"])


def _available(router: RouterServer) -> list[str]:
    return [e["url"] for e in _engines(router) if e["available"]]


def test_parse_load_sums_running_and_waiting() -> None:
    """Load is running + waiting over all label sets; KV usage is read too."""
    text = (
        '# HELP x\nvllm:num_requests_running{model_name="m",engine="0"} 3.0\n'
        'vllm:num_requests_waiting{model_name="m",engine="0"} 2.0\n'
        'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.25\n'
        "vllm:num_requests_running_other 9\n"
    )
    assert parse_load(text) == (5.0, 0.25)


def test_failed_health_checks_take_an_engine_out_and_back(cluster: FakeCluster) -> None:
    """An engine whose /health fails gets no requests until it passes again."""
    a, a_server = cluster.add()
    b, _ = cluster.add()
    with routed(cluster) as router:
        a.healthy = False
        _eventually(lambda: _available(router) == [cluster.engines[1][1].url])
        for _ in range(4):
            httpx.post(f"{router.url}/v1/completions", json=BODY).raise_for_status()
        assert len(a.requests) == 0 and len(b.requests) == 4
        a.healthy = True
        _eventually(lambda: a_server.url in _available(router))
        for _ in range(4):
            httpx.post(f"{router.url}/v1/completions", json=BODY).raise_for_status()
        assert len(a.requests) > 0


def test_a_dead_engine_is_ejected_and_recovers_when_it_returns(cluster: FakeCluster) -> None:
    """Requests to a stopped engine fail over without errors to the client; the engine is
    ejected, and back in rotation once it serves again on its address."""
    a, a_server = cluster.add()
    cluster.add()
    slow_checks: dict[str, Any] = {
        "health_interval": 2.0,
        "eject_seconds": 0.2,
        "decode_policy": "round-robin",
    }
    with routed(cluster, **slow_checks) as router:
        a_server.stop()
        codes = [
            httpx.post(f"{router.url}/v1/completions", json=BODY).status_code for _ in range(6)
        ]
        assert codes == [200] * 6
        assert router.metric("baton:router_ejections_total", engine=a_server.url) == 1
        assert router.metric("baton:router_upstream_errors_total", kind="connect") == 2
        assert a_server.url not in _available(router)
        again = ThreadServer(a.app, port=a_server.port).start()
        cluster.engines.append((a, again))
        _eventually(lambda: a_server.url in _available(router))
        before = len(a.requests)
        for _ in range(4):
            httpx.post(f"{router.url}/v1/completions", json=BODY).raise_for_status()
        assert len(a.requests) - before == 2


def test_least_load_follows_the_engines_metrics(cluster: FakeCluster) -> None:
    """least-load sends work away from an engine whose /metrics show a long queue."""
    busy, _ = cluster.add()
    idle, _ = cluster.add()
    busy.waiting = 20
    with routed(cluster, decode_policy="least-load") as router:
        _eventually(
            lambda: any(
                e["load"] >= 20 for e in httpx.get(f"{router.url}/engines").json()["engines"]
            )
        )
        for _ in range(5):
            httpx.post(f"{router.url}/v1/completions", json=BODY).raise_for_status()
        assert len(busy.requests) == 0 and len(idle.requests) == 5


def test_discovery_changes_add_and_remove_engines(cluster: FakeCluster) -> None:
    """Engines leaving the discovered set get no more requests; new ones are checked and used."""
    a, a_server = cluster.add()
    _, b_server = cluster.add()
    with routed(cluster) as router:
        assert router.loop is not None
        only_b = frozenset({Endpoint(b_server.url, "both")})
        router.loop.call_soon_threadsafe(router.router.on_discovery, only_b)
        _eventually(lambda: _available(router) == [b_server.url])
        for _ in range(3):
            httpx.post(f"{router.url}/v1/completions", json=BODY).raise_for_status()
        assert len(a.requests) == 0
        both = frozenset({Endpoint(a_server.url, "both"), Endpoint(b_server.url, "both")})
        router.loop.call_soon_threadsafe(router.router.on_discovery, both)
        _eventually(lambda: len(_available(router)) == 2)
