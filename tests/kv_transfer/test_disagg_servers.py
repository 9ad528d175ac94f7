"""Disaggregated serving with real processes: a prefill engine server and a decode engine server
hand prompts' KV over, driven step by step with an HTTP client, and equal a single engine's
answers; faults (a dead prefill engine, a stalled or lying peer, an unclaimed lease) end every
request within its deadline and leak no blocks."""

from __future__ import annotations

import importlib
import os
import random
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from baton.kv_transfer.keyring import KeyRing, new_secret
from baton.kv_transfer.params import KVTransferParams
from tests.support.engine_server import Server, expect_error, start_all, stop_all
from tests.support.kv_peers import BadKVPeer
from tests.support.kv_wire import resigned
from tests.support.procs import engine_core_pid

pytestmark = pytest.mark.slow

BLOCK = "8"
MAX_TOKENS = 6

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@pytest.fixture(scope="module")
def model(tiny_model: Any) -> Path:
    return Path(tiny_model("llama"))


def _has_nixl() -> bool:
    try:
        importlib.import_module("baton.kv_transfer.nixl.transport")
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def stack(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """Every engine of the module by name, started side by side: a single engine, a TCP
    prefill and decode engine, a NIXL pair where NIXL imports, and a prefill engine whose
    leases last 1 s (test_unclaimed_lease_expires reads it, then
    test_prefill_engine_killed_before_the_pull kills it: the order of this file)."""
    tmp = tmp_path_factory.mktemp("stack")
    tcp = ("--block-size", BLOCK, "--kv-transport", "tcp")  # the fault peers speak TCP
    flags = {
        "single": ("--block-size", BLOCK),
        "prefill": (*tcp, "--role", "prefill"),
        "decode": (*tcp, "--role", "decode", "--kv-load-timeout", "3"),
        "short-lease": (*tcp, "--role", "prefill", "--kv-lease-seconds", "1"),
    }
    if _has_nixl():
        nixl = ("--block-size", BLOCK, "--kv-transport", "nixl")
        flags["nixl-prefill"] = (*nixl, "--role", "prefill")
        flags["nixl-decode"] = (*nixl, "--role", "decode", "--kv-load-timeout", "3")
    servers = start_all(model, tmp, flags)
    try:
        yield servers
    finally:
        # The fault tests leave leases unclaimed on purpose: no need to wait them out.
        stop_all(servers.values(), drain_seconds=0.5)


@pytest.fixture(scope="module")
def single(stack: dict[str, Server]) -> Server:
    return stack["single"]


@pytest.fixture(params=["tcp", "nixl"])
def pair(request: pytest.FixtureRequest, stack: dict[str, Server]) -> tuple[str, Server, Server]:
    """(transport, prefill, decode): the stack's TCP engines, or its NIXL ones (skipped where
    NIXL is not installed)."""
    if request.param == "tcp":
        return "tcp", stack["prefill"], stack["decode"]
    pytest.importorskip(
        "baton.kv_transfer.nixl.transport", reason="NIXL is not installed", exc_type=ImportError
    )
    return "nixl", stack["nixl-prefill"], stack["nixl-decode"]


@pytest.fixture(scope="module")
def prefill(stack: dict[str, Server]) -> Server:
    return stack["prefill"]


@pytest.fixture(scope="module")
def decode(stack: dict[str, Server]) -> Server:
    return stack["decode"]


def _complete(server: Server, prompt: list[int], **extra: Any) -> httpx.Response:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def _prefill_step(prefill: Server, prompt: list[int]) -> dict[str, Any]:
    r = _complete(prefill, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params is not None
    return dict(params)


def _tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["token_ids"])


def _wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _prompts() -> list[list[int]]:
    """32 prompts: 1 to ~200 tokens (shorter than a block to many blocks), some repeated (cached on
    the prefill side) and some extending an earlier one (a partly cached prefix)."""
    rng = random.Random(7)
    lengths = (1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 65, 100, 127, 150, 200, 5, 12, 40, 80)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in lengths]
    prompts += [list(prompts[i]) for i in (4, 10, 13, 15)]  # exact repeats
    extend = ((10, 1), (11, 9), (12, 30), (13, 2), (14, 8), (15, 20), (3, 1), (6, 40))
    prompts += [prompts[i] + [rng.randrange(5, 500) for _ in range(k)] for i, k in extend]
    assert len(prompts) == 32
    return prompts


def test_disaggregated_answers_equal_the_single_engine(
    single: Server, pair: tuple[str, Server, Server]
) -> None:
    """32 prompts of mixed lengths through prefill → pull → decode give the single engine's
    greedy tokens, over each transport; the decode engine pulled bytes and recorded no failures;
    once idle, the prefill engine holds no leased blocks."""
    transport, prefill, decode = pair
    prompts = _prompts()
    want = [_tokens(_complete(single, p)) for p in prompts]

    def hand_off(prompt: list[int]) -> tuple[dict[str, Any], list[int]]:
        params = _prefill_step(prefill, prompt)
        return params, _tokens(_complete(decode, prompt, kv_transfer_params=params))

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(hand_off, prompts))
    for i, (prompt, (params, tokens)) in enumerate(zip(prompts, got, strict=True)):
        assert tokens == want[i], f"prompt {i} ({len(prompt)} tokens)"
        assert params["num_prompt_tokens"] == len(prompt)
        assert len(params["remote_block_ids"]) == -(-len(prompt) // int(BLOCK))
        assert params["lease_expires_at"] > time.time()
    metrics = decode.metrics()
    assert metrics["baton:kv_transfer_bytes_total{}"] > 0
    # vLLM's prompt-token sources: the hand-offs' tokens came from the prefill engine.
    source = {s: metrics[f'vllm:prompt_tokens_by_source_total{{source="{s}"}}'] for s in SOURCES}
    assert source["external_kv_transfer"] > 0
    assert sum(source.values()) == metrics["vllm:prompt_tokens_total{}"]
    cached = source["external_kv_transfer"] + source["local_cache_hit"]
    assert metrics["vllm:prompt_tokens_cached_total{}"] == cached
    assert not [k for k in metrics if k.startswith("baton:kv_transfer_failures_total")]
    _wait_for(
        lambda: prefill.metrics()["baton:kv_blocks_leased{}"] == 0,
        10,
        "the prefill engine still holds leased blocks",
    )
    assert prefill.metrics()["vllm:kv_cache_usage_perc{}"] == 0.0
    health = httpx.get(f"{prefill.url}/health").json()
    assert (health["role"], health["kv_transport"]) == ("prefill", transport)


def test_unclaimed_lease_expires(stack: dict[str, Server]) -> None:
    """The decode side never pulls: the lease expires after --kv-lease-seconds and the prefill
    engine's blocks return to its pool, counted in baton:kv_lease_expired_total."""
    s = stack["short-lease"]
    _prefill_step(s, list(range(10, 60)))
    assert s.metrics()["baton:kv_blocks_leased{}"] == 7
    _wait_for(lambda: s.metrics()["baton:kv_lease_expired_total{}"] == 1, 5, "lease not expired")
    m = s.metrics()
    assert m["baton:kv_blocks_leased{}"] == 0 and m["vllm:kv_cache_usage_perc{}"] == 0.0


def test_prefill_engine_killed_before_the_pull(
    stack: dict[str, Server], single: Server, decode: Server
) -> None:
    """The prefill engine dies after answering: the decode engine recomputes (policy recompute)
    or answers a clear 503 (policy fail), within the load timeout. (The victim is the stack's
    short-lease engine, done with above; the decode side never looks at the lease's end.)"""
    victim = stack["short-lease"]
    prompts = {"recompute": list(range(100, 140)), "fail": list(range(140, 170))}
    try:
        params = {policy: _prefill_step(victim, prompt) for policy, prompt in prompts.items()}
    finally:
        core = engine_core_pid(victim.proc.pid)
        victim.proc.kill()  # the whole engine dies: its API server and its core
        os.kill(core, signal.SIGKILL)
        victim.proc.wait(10)
        victim.stop()
    for policy, prompt in prompts.items():
        start = time.monotonic()
        r = _complete(
            decode, prompt, kv_transfer_params=params[policy] | {"kv_load_failure_policy": policy}
        )
        assert time.monotonic() - start < 5
        if policy == "recompute":
            assert _tokens(r) == _tokens(_complete(single, prompt))
        else:
            error = expect_error(r, 503)
            assert error["message"].startswith("KV cache transfer from the prefill engine failed")


def test_params_of_a_restarted_engine_recompute(
    prefill: Server, decode: Server, single: Server
) -> None:
    """An engine id that is not the one now at that address is refused by the prefill side and
    the decode side recomputes: the answer is still right, and the failure is counted."""
    prompt = list(range(200, 230))
    params = resigned(_prefill_step(prefill, prompt), prompt, remote_engine_id="0" * 32)
    assert _tokens(_complete(decode, prompt, kv_transfer_params=params)) == _tokens(
        _complete(single, prompt)
    )
    assert decode.metrics()['baton:kv_transfer_failures_total{reason="UNKNOWN_ENGINE"}'] >= 1


@pytest.mark.parametrize("mode", ["stall", "short", "corrupt"])
def test_bad_peers_are_detected_and_recomputed(
    prefill: Server, decode: Server, single: Server, mode: str
) -> None:
    """A peer that stalls, hangs up mid-transfer or sends bytes that fail the checksum: the
    decode engine detects it (within --kv-load-timeout for the stall) and recomputes."""
    prompt = list(range(300, 345))
    params = _prefill_step(prefill, prompt)
    peer = BadKVPeer(mode)
    try:
        start = time.monotonic()
        r = _complete(
            decode,
            prompt,
            kv_transfer_params=resigned(
                params, prompt, remote_port=peer.port, remote_ports=[peer.port]
            ),
        )
        assert time.monotonic() - start < 6
        assert _tokens(r) == _tokens(_complete(single, prompt))
    finally:
        peer.close()
    reason = {"stall": "DEADLINE", "short": "SHORT_READ", "corrupt": "CHECKSUM_MISMATCH"}[mode]
    assert decode.metrics()[f'baton:kv_transfer_failures_total{{reason="{reason}"}}'] >= 1


def test_bad_kv_transfer_params_are_400(prefill: Server, decode: Server) -> None:
    """Malformed params, or a hand-off asked of the wrong role, get a 400 naming the problem."""
    bad = {"do_remote_prefill": True, "remote_port": "x"}
    error = expect_error(_complete(decode, [1, 2, 3], kv_transfer_params=bad), 400)
    assert error["param"] == "kv_transfer_params"
    error = expect_error(
        _complete(decode, [1, 2], kv_transfer_params={"do_remote_decode": True}), 400
    )
    assert "role" in error["message"]
    error = expect_error(
        _complete(
            prefill, [1, 2], kv_transfer_params={"do_remote_decode": True}, n=2, temperature=1.0
        ),
        400,
    )
    assert "n=1" in error["message"]
    policy = {"do_remote_decode": True, "kv_load_failure_policy": "retry"}
    expect_error(_complete(prefill, [1, 2], kv_transfer_params=policy), 400)
    # Shards laid out for another tensor_parallel_size are refused, naming both sizes.
    prompt = list(range(400, 420))
    params = _prefill_step(prefill, prompt)
    two_ranks = params | {"remote_ports": [params["remote_port"], params["remote_port"] + 1]}
    error = expect_error(_complete(decode, prompt, kv_transfer_params=two_ranks), 400)
    assert "tensor_parallel_size 2" in error["message"] and "decode engine 1" in error["message"]
    other_rank0 = params | {"remote_ports": [params["remote_port"] + 1]}
    error = expect_error(_complete(decode, prompt, kv_transfer_params=other_rank0), 400)
    assert "remote_ports[0]" in error["message"]


def test_a_reused_client_request_id_cannot_corrupt_a_live_hand_off(
    single: Server, prefill: Server, decode: Server
) -> None:
    """Two prompts prefilled under one client request_id while the first one's lease is alive:
    each decode reads its own prompt's KV (the single engine's tokens), with no failed pull, and
    the prefill engine's prefix cache still answers the first prompt right. Engine-side ids were
    the client's: the second prefill took over the first one's leased blocks and wrote its own
    KV into them, under the first prompt's cached hashes."""
    prompts = [[(7 * i + 3 * k) % 450 + 30 for i in range(40)] for k in (1, 2)]
    want = [_tokens(_complete(single, p)) for p in prompts]
    leases = []
    for prompt in prompts:
        r = _complete(prefill, prompt, max_tokens=1, request_id="reused",
                      kv_transfer_params={"do_remote_decode": True})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "cmpl-reused"  # the client's id names the response
        leases.append(r.json()["kv_transfer_params"])
    assert leases[0]["remote_request_id"] != leases[1]["remote_request_id"]
    for prompt, params, tokens in zip(prompts, leases, want, strict=True):
        strict = {**params, "kv_load_failure_policy": "fail"}  # no silent recompute
        r = _complete(decode, prompt, request_id="reused", kv_transfer_params=strict)
        assert _tokens(r) == tokens
        assert r.json()["id"] == "cmpl-reused"
    assert _tokens(_complete(prefill, prompts[0])) == want[0]  # its prefix cache is sound


def test_forged_params_reach_no_address_and_are_a_400(prefill: Server, decode: Server) -> None:
    """Params a client made up (unsigned, signed under another key, or a prefill engine's
    params changed to point elsewhere) are a 400 naming why, and the decode engine connects to
    nothing they name."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    prompt = list(range(300, 340))
    params = _prefill_step(prefill, prompt)
    other = KeyRing(new_secret(), "another service's key")
    theirs = KVTransferParams.parse(params)
    assert theirs is not None and theirs.remote is not None
    cases = {
        "not signed": {k: v for k, v in params.items() if k not in ("signature", "key_id")}
        | {"remote_port": port, "remote_ports": [port]},
        "does not hold": KVTransferParams.lease(theirs.remote.signed(other, prompt)).to_json(),
        "changed after": params | {"remote_port": port, "remote_ports": [port]},
    }
    try:
        for why, forged in cases.items():
            error = expect_error(_complete(decode, prompt, kv_transfer_params=forged), 400)
            assert error["param"] == "kv_transfer_params" and why in error["message"], why
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    # The real params still work once the forgeries are refused (the lease was never touched).
    assert _tokens(_complete(decode, prompt, kv_transfer_params=params))
