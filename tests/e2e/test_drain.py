"""Graceful drain over real processes: SIGTERM to a decode engine, to a prefill engine holding
leases, and to the router. Admission stops at once (503, the router routes around), what is in
flight finishes, leases are claimed or expire before a prefill engine exits."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import (
    Fleet,
    complete,
    decode_step,
    open_stream,
    prefill_step,
    prompt_ids,
    record,
    stop_core,
    tokens,
    wait_idle,
)
from tests.support.procs import wait_exit

pytestmark = pytest.mark.slow

STREAM_TOKENS = 400


def test_sigterm_to_a_decode_engine_drains(fleet: Fleet, make_router: Any) -> None:
    """SIGTERM to a decode engine with streams in flight: its /health turns 503 and new
    requests to it get 503, the router sends new requests to the other decode engine, the
    streams finish whole, and the engine exits 0."""
    victim, p0, d0 = fleet["d_drain"], fleet["p0"], fleet["d0"]
    router = make_router([p0], [victim, d0], "--decode-policy", "round-robin")
    # Long enough that no stream can end between its first token and the core's SIGSTOP below,
    # however slowly a loaded machine runs this test.
    streams = [open_stream(router.url, f"drain stream {i}", STREAM_TOKENS) for i in range(4)]
    for s in streams:
        s.read(1)
    on_victim = [s for s in streams if s.engine == victim.url]
    assert on_victim
    # The victim's core stops until the checks below are done: its streams cannot end (and the
    # engine exit) before them.
    core = stop_core(fleet, "d_drain")
    victim.proc.terminate()
    start = time.monotonic()
    deadline = start + 5
    while httpx.get(f"{victim.url}/health", timeout=2).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert complete(victim.url, "refused while draining").status_code == 503
    with ThreadPoolExecutor(4) as pool:
        routed = list(pool.map(lambda i: complete(router.url, f"during drain {i}"), range(4)))
    assert [r.status_code for r in routed] == [200] * 4
    assert {r.headers["x-baton-engine"] for r in routed} == {d0.url}
    core.signal(signal.SIGCONT)
    ends = [s.finish() for s in streams]
    assert all(kind == "done" and len(ids) == STREAM_TOKENS for kind, ids in ends), ends
    t_streams = time.monotonic() - start
    assert victim.proc.wait(20) == 0
    record(
        "SIGTERM decode engine",
        "streams in flight",
        "503 to new, streams complete, exit 0",
        time.monotonic() - start,
    )
    assert t_streams < 20
    wait_idle(p0)
    wait_idle(d0)


def test_sigterm_to_a_prefill_engine_waits_for_its_leases(fleet: Fleet) -> None:
    """SIGTERM to a prefill engine that holds two leases: it stops admitting (503) but keeps
    serving its blocks; the first lease, claimed after the signal, is pulled (not recomputed);
    the engine exits 0 only once the second has expired (--kv-lease-seconds 4)."""
    victim, d0 = fleet["p_drain"], fleet["d0"]
    claimed, unclaimed = prompt_ids(101), prompt_ids(102)
    want = tokens(complete(fleet["p0"].url, claimed))  # not d0: it would not pull
    params = prefill_step(victim, claimed)
    prefill_step(victim, unclaimed)
    leased_at = time.monotonic()
    failures = _failures(d0)
    pulled = d0.metrics()["baton:kv_transfer_bytes_total{}"]
    victim.proc.terminate()
    start = time.monotonic()
    time.sleep(1.0)
    assert victim.proc.poll() is None, "exited with leases outstanding"
    assert httpx.get(f"{victim.url}/health", timeout=2).status_code == 503
    assert tokens(decode_step(d0, claimed, params)) == want
    assert _failures(d0) == failures, "the pull failed: the blocks were gone"
    assert d0.metrics()["baton:kv_transfer_bytes_total{}"] > pulled
    code = victim.proc.wait(15)
    exited = time.monotonic() - leased_at
    assert code == 0
    assert 4 - 0.5 < exited < 4 + 5, exited  # the unclaimed lease expired first
    record(
        "SIGTERM prefill engine",
        "2 leases outstanding (1 claimed after the signal)",
        "claimed one pulled; exit 0 after the other expired",
        time.monotonic() - start,
    )
    wait_idle(d0)


def _failures(server: Any) -> float:
    m = server.metrics()
    return sum(v for k, v in m.items() if k.startswith("baton:kv_transfer_failures_total"))


def test_sigterm_to_the_router_finishes_open_streams(fleet: Fleet, make_router: Any) -> None:
    """SIGTERM to the router with streams open: new connections are refused, every open
    stream still arrives whole, then the router exits 0."""
    p0, d0 = fleet["p0"], fleet["d0"]
    router = make_router([p0], [d0])
    streams = [open_stream(router.url, f"router drain {i}", 120) for i in range(3)]
    for s in streams:
        s.read(1)
    router.proc.terminate()
    start = time.monotonic()
    while True:  # the listener closes once the router has the signal
        try:
            httpx.get(f"{router.url}/health", timeout=2)
        # Refused, or taken from the backlog and reset or closed without an answer: either way
        # not served (a closed one is "Server disconnected without sending a response").
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            break
        assert time.monotonic() - start < 5, "the router still accepts connections"
        time.sleep(0.05)
    ends = [s.finish() for s in streams]
    assert all(kind == "done" and len(ids) == 120 for kind, ids in ends), ends
    assert router.proc.wait(10) == 0
    record("SIGTERM router", "3 streams open", "streams complete, exit 0", time.monotonic() - start)
    wait_exit(router.proc.pid, 1)
    wait_idle(p0)
    wait_idle(d0)
