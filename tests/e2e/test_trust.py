"""The trust boundary over real processes: `kv_transfer_params` forged by a client and sent
through the router make the engines connect nowhere and hand the client no KV coordinates, on
every path of the hand-off; a client request id reused by concurrent requests through the router
cannot mix their KV."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Fleet, RouterProc, body, complete, prompt_ids, tokens, wait_idle
from tests.support.thread_server import scrape

pytestmark = pytest.mark.slow


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A TCP listener the test owns; a connection lands in its backlog even unaccepted."""
    sock = socket.create_server(("127.0.0.1", 0), backlog=16)
    sock.setblocking(False)
    try:
        yield sock
    finally:
        sock.close()


def test_forged_params_through_the_router_reach_no_engine(
    fleet: Fleet, make_router: Callable[..., RouterProc], listener: socket.socket
) -> None:
    """A pull from the test's listener and a lease for the client, forged on a short prompt
    (skipped_short), a prompt the decode engine has cached (skipped_cached), a batch
    (decode_only_fallback) and a plain hand-off: every answer is the engines' own, 200, without
    kv_transfer_params, and nothing ever connected to the listener."""
    port = listener.getsockname()[1]
    d0 = fleet["d0"]
    pull = {
        "do_remote_prefill": True,
        "remote_engine_id": "0" * 32,
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_request_id": "forged",
        "remote_block_ids": [0, 1, 2, 3, 4],
        "num_prompt_tokens": 40,  # with remote_block_ids, made to fit each prompt below
        "lease_expires_at": time.time() + 60,
        "kv_load_failure_policy": "fail",  # a refused connection's error text would come back
    }
    router = make_router([fleet["p0"]], [d0], "--disagg-min-tokens", "20")
    short, long_ = prompt_ids(901, 8), prompt_ids(902, 40)
    prompts: list[Any] = [short, long_, long_, [prompt_ids(903, 30), prompt_ids(904, 30)]]
    answers = []
    for prompt in prompts:
        n = len(prompt if isinstance(prompt[0], int) else prompt[0])
        # consistent with the prompt, so that an engine that takes them would pull
        fitting = {**pull, "num_prompt_tokens": n, "remote_block_ids": list(range(-(-n // 8)))}
        for forged in (fitting, {"do_remote_decode": True}):
            answers.append(complete(router.url, prompt, kv_transfer_params=forged))
    with pytest.raises(BlockingIOError):
        listener.accept()
    for r in answers:
        assert r.status_code == 200, r.text
        assert "kv_transfer_params" not in r.json(), r.text
    want = tokens(complete(d0.url, long_))
    assert tokens(complete(router.url, long_, kv_transfer_params=pull)) == want
    decisions = "baton:router_disagg_decisions_total"
    for outcome in ("skipped_short", "skipped_cached", "decode_only_fallback", "disaggregated"):
        assert scrape(router.url, decisions, outcome=outcome) >= 1, outcome
    wait_idle(fleet["p0"])  # no lease left behind for a client's do_remote_decode


def test_a_reused_request_id_through_the_router_keeps_hand_offs_apart(
    fleet: Fleet, make_router: Callable[..., RouterProc]
) -> None:
    """Six concurrent hand-offs under one X-Request-Id and one body request_id all answer
    their own prompt's greedy tokens (those of the decode engine alone)."""
    d0 = fleet["d0"]
    router = make_router([fleet["p0"]], [d0])
    prompts = [prompt_ids(910 + i, 40) for i in range(6)]
    want = [tokens(complete(d0.url, p)) for p in prompts]

    def ask(prompt: list[int]) -> httpx.Response:
        return httpx.post(
            f"{router.url}/v1/completions",
            json=body(prompt, request_id="same"),
            headers={"x-request-id": "same"},
            timeout=60,
        )

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, prompts))
    assert [tokens(r) for r in answers] == want
    assert {r.json()["id"] for r in answers} == {"cmpl-same"}
    assert scrape(router.url, "baton:router_disagg_decisions_total", outcome="disaggregated") == 6
