"""The router keeps the KV plane to itself: a client's forged `kv_transfer_params` reach no
engine on any path (aggregated, skipped prefill, batch, fallback, retry, /tokenize), and no
engine's KV coordinates reach a client."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.router.harness import FakeCluster, routed
from tests.support.fake_engine import FakeEngine

LONG = "The relay team passes the baton in a marked zone. " * 8  # ~400 characters
FORGED_ID = "forged-by-the-client"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A TCP listener the test owns, where forged params send decode engines."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.setblocking(False)
    try:
        yield sock
    finally:
        sock.close()


def _forgeries(port: int) -> list[dict[str, Any]]:
    pull = {
        "do_remote_prefill": True,
        "remote_engine_id": "e" * 32,
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_request_id": FORGED_ID,
        "remote_block_ids": [0, 1, 2],
        "num_prompt_tokens": 40,
        "lease_expires_at": time.time() + 60,
    }
    return [pull, {"do_remote_decode": True, "remote_request_id": FORGED_ID}]


def _no_connection(sock: socket.socket) -> None:
    with pytest.raises(BlockingIOError):
        sock.accept()


def _clean(engine: FakeEngine, own: set[int]) -> None:
    """Every body `engine` got carries no forged params: none, or the router's own (a prefill
    request's do_remote_decode, or a lease of one of the cluster's engines on port `own`)."""
    for body in engine.requests + engine.tokenize_requests:
        assert FORGED_ID not in json.dumps(body), body
        params = body.get("kv_transfer_params")
        if params is not None:
            assert params == {"do_remote_decode": True} or params["remote_port"] in own, body


def test_forged_kv_transfer_params_reach_no_engine(
    cluster: FakeCluster, listener: socket.socket
) -> None:
    """On every path, the router strips the client's kv_transfer_params and drops the engines'
    from whole answers; an aggregated engine leases nothing on a client's demand."""
    agg, _ = cluster.add("both", model="agg")
    agg_bad, _ = cluster.add("both", model="agg")
    prefill, _ = cluster.add("prefill")
    decode, _ = cluster.add("decode")
    agg_bad.fail_status = 503  # every other aggregated request is retried on `agg`
    own = {e.port for e, _ in cluster.engines}
    port = listener.getsockname()[1]
    url: str
    with routed(cluster, decode_policy="round-robin", disagg_min_tokens=50) as router:
        url = router.url
        for i, forged in enumerate(_forgeries(port)):
            sends: list[tuple[str, dict[str, Any]]] = [
                # aggregated, whole and streamed, some retried after the 503
                ("/v1/completions", {"model": "agg", "prompt": f"{i} {LONG}"}),
                ("/v1/completions", {"model": "agg", "prompt": f"{i}b {LONG}"}),
                ("/v1/chat/completions", {"model": "agg", "messages": CHAT, "stream": True}),
                # disaggregated, then skipped_cached for the longer prompt
                ("/v1/completions", {"model": "fake", "prompt": f"{i} {LONG}"}),
                ("/v1/completions", {"model": "fake", "prompt": f"{i} {LONG} and more"}),
                ("/v1/completions", {"model": "fake", "prompt": "short"}),  # skipped_short
                ("/v1/completions", {"model": "fake", "prompt": [LONG, LONG + "b"]}),  # batch
                ("/tokenize", {"model": "fake", "prompt": "hi"}),
            ]
            for route, body in sends:
                sent = {**body, "max_tokens": 2, "kv_transfer_params": forged}
                r = httpx.post(f"{url}{route}", json=sent)
                assert r.status_code == 200, (route, r.text)
                assert "kv_transfer_params" not in r.text, (route, r.text)
        outcomes = {
            o: router.metric("baton:router_disagg_decisions_total", outcome=o)
            for o in ("disaggregated", "skipped_cached", "skipped_short", "decode_only_fallback")
        }
        assert all(n >= 2 for n in outcomes.values()), outcomes
        assert router.metric("baton:router_retries_total", route="/v1/completions") >= 1
    # decode_only_fallback with no prefill engine at all
    engines = list(cluster.engines)
    cluster.engines[2][1].stop()
    del cluster.engines[2]
    with routed(cluster, on_no_prefill="decode") as router:
        for forged in _forgeries(port):
            body = {"model": "fake", "prompt": LONG, "max_tokens": 2, "kv_transfer_params": forged}
            r = httpx.post(f"{router.url}/v1/completions", json=body)
            assert r.status_code == 200 and "kv_transfer_params" not in r.text, r.text
    assert agg.prefills == 0 and agg.remote_decodes == 0
    for engine, _ in engines:
        _clean(engine, own)
    assert decode.remote_decodes == prefill.prefills == 2  # only the router's own hand-offs
    _no_connection(listener)


def test_engine_kv_coordinates_never_reach_a_client() -> None:
    from baton.router.proxy import without_kv_params

    """A whole answer that carries kv_transfer_params (an engine that returns them unasked)
    reaches the client without them; the rest of the answer is unchanged."""
    answer = {"id": "x", "choices": [{"text": "kv_transfer_params"}], "kv_transfer_params": {}}
    stripped = json.loads(without_kv_params(json.dumps(answer).encode()) or b"")
    assert stripped == {"id": "x", "choices": [{"text": "kv_transfer_params"}]}
    text_only = json.dumps({"choices": [{"text": "kv_transfer_params"}]}).encode()
    assert without_kv_params(text_only) is text_only
    assert without_kv_params(b"not json kv_transfer_params") == b"not json kv_transfer_params"
