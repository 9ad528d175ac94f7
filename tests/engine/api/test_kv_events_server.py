"""The engine server's side of KV cache events and `cache_salt`: the flag, /health, the events
its core process publishes (read as vLLM's consumers read them), and tenants' salts kept apart
in the prefix cache (the engine's own hit counter)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from baton.block_hash import HASH_SCHEME
from baton.engine.api.cli import add_server_args, configs_from_args
from tests.support.engine_server import NAME, Server, expect_error, start_server
from tests.support.ports import free_port
from tests.support.vllm_kv_events import Subscriber, apply

TOPIC = "kv"
# Long enough for several 16-token blocks with any tokenizer of the test models.
PROMPT = "The relay team passed the baton at every corner of the long track, again and again. " * 3


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return parser.parse_args(list(argv))


def test_kv_events_flag_reaches_the_engine_args() -> None:
    """--kv-events-config takes vLLM's JSON into EngineArgs; without it events are off."""
    config = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5590", "topic": "t"}'
    engine, _ = configs_from_args(_parse("--kv-events-config", config))
    events = engine.kv_events_config
    assert events is not None and events.enabled and engine.kv_events_enabled
    assert (events.endpoint, events.topic, events.replay_endpoint) == ("tcp://*:5590", "t", None)
    engine, _ = configs_from_args(_parse())
    assert engine.kv_events_config is None and not engine.kv_events_enabled


@pytest.mark.parametrize(
    ("value", "why"),
    [("{not json", "kv-events-config"), ('{"enable_kv_events": true}', "enable_kv_events")],
)
def test_bad_kv_events_config_is_a_cli_error(
    value: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Malformed JSON or an unknown key stops the parse with a message naming the flag."""
    with pytest.raises(SystemExit):
        _parse("--kv-events-config", value)
    err = capsys.readouterr().err
    assert "--kv-events-config" in err and why in err


def test_kv_events_port_zero_is_refused() -> None:
    """The port must be fixed (the router connects to it): 0 is a ValueError saying so."""
    config = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0"}'
    with pytest.raises(ValueError, match="port 0"):
        configs_from_args(_parse("--kv-events-config", config))


# ---- the package's shared server (no events) -------------------------------------------------


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_empty_cache_salt_is_a_400(server: Server, route: str) -> None:
    """vLLM's rule: a cache_salt, when sent, is a non-empty string."""
    body = _body(route, max_tokens=1, cache_salt="")
    error = expect_error(httpx.post(f"{server.url}{route}", json=body, timeout=30), 400)
    assert error["param"] == "cache_salt" and "non-empty" in error["message"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_cache_salt_is_accepted(server: Server, route: str) -> None:
    """A salted request is served like any other, on completions and chat."""
    response = httpx.post(
        f"{server.url}{route}", json=_body(route, max_tokens=2, cache_salt="t"), timeout=60
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_health_says_how_prompts_hash(server: Server) -> None:
    """/health gives the block size and hash scheme always, and no kv_events when off."""
    health = httpx.get(f"{server.url}/health", timeout=5).json()
    assert (health["block_size"], health["hash"], health["kv_events"]) == (16, HASH_SCHEME, None)


# ---- a server that publishes --------------------------------------------------------------


@pytest.fixture(scope="module")
def publishing(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port, replay_port = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": TOPIC,
    }
    s = start_server(
        model, tmp_path_factory.mktemp("events"), "--kv-events-config", json.dumps(config)
    )
    try:
        yield s
    finally:
        s.stop()


def _body(route: str, **fields: Any) -> dict[str, Any]:
    if route == "/v1/completions":
        return {"model": NAME, "prompt": PROMPT, "temperature": 0, **fields}
    return {
        "model": NAME,
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        **fields,
    }


def _hits(server: Server) -> float:
    metrics = server.metrics()
    return next(v for k, v in metrics.items() if k.startswith("vllm:prefix_cache_hits"))


def _port(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


def test_health_advertises_the_events_endpoint(publishing: Server) -> None:
    """/health names the endpoints as configured, the topic, block size and hash scheme."""
    events = httpx.get(f"{publishing.url}/health", timeout=5).json()["kv_events"]
    assert set(events) == {
        "endpoint", "replay_endpoint", "topic", "block_size", "hash", "instance"
    }  # fmt: skip
    assert events["endpoint"].startswith("tcp://127.0.0.1:") and events["topic"] == TOPIC
    assert (events["block_size"], events["hash"]) == (16, HASH_SCHEME)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_salts_keep_tenants_apart_and_events_flow(publishing: Server, route: str) -> None:
    """Tenant a's prompt stores blocks (published from the core process: AllBlocksCleared first,
    then BlockStored); tenant b's same prompt hits none of them, a's repeat hits."""
    events = httpx.get(f"{publishing.url}/health", timeout=5).json()["kv_events"]
    ctx: zmq.Context[Any] = zmq.Context()
    sub = Subscriber(
        ctx, _port(events["endpoint"]), _port(events["replay_endpoint"]), TOPIC.encode()
    )
    url = f"{publishing.url}{route}"
    try:
        replayed = sub.replay(0)
        index: set[int] = set()
        assert apply(index, replayed[0][1], 16) == ["AllBlocksCleared"]
        for _, payload in replayed[1:]:
            apply(index, payload, 16)
        last_seq = replayed[-1][0]

        def post(salt: str) -> dict[str, Any]:
            body = _body(route, max_tokens=1, cache_salt=salt)
            response = httpx.post(url, json=body, timeout=60)
            assert response.status_code == 200, response.text
            return dict(response.json()["usage"])

        salt_a, salt_b = f"{route}-a", f"{route}-b"
        before = _hits(publishing)
        post(salt_a)
        got = sub.recv()
        assert got is not None and got[0] == last_seq + 1
        assert "BlockStored" in apply(index, got[1], 16)
        post(salt_b)
        assert _hits(publishing) == before
        usage = post(salt_a)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 16 and _hits(publishing) == before + cached
    finally:
        sub.close()
        ctx.term()
