"""Fault injection over real processes: `kill -9` of a prefill or decode engine server, of an
EngineCore child and of the router, each while requests stand at different moments of the
hand-off (before the prefill answer, between the answer and the pull, during the pull,
mid-stream); connections between engines cut; a decode pool so small it must preempt.

After each fault: every request ended (completed, or a clear error, within its client timeout),
the survivors hold no block, lease or request once idle, and they serve a fresh request. Each
outcome and its time to final state is recorded for docs/reliability.md.

Faults the engine-pair suite covers already (tests/kv_transfer/test_disagg_servers.py): a prefill
engine killed between its answer and the pull (both policies), a peer that stalls, hangs up or
corrupts, an unclaimed lease expiring, params of a restarted engine.
"""

from __future__ import annotations

import itertools
import signal
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from baton.kv_transfer.sockets import GREETING
from tests.e2e.conftest import (
    LOAD_TIMEOUT,
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
from tests.support.kv_peers import BadKVPeer
from tests.support.kv_wire import resigned
from tests.support.procs import wait_exit

pytestmark = pytest.mark.slow

_FRESH = itertools.count(1000)  # seeds of prompts no engine has cached yet


def _failures(server: Any) -> float:
    m = server.metrics()
    return sum(v for k, v in m.items() if k.startswith("baton:kv_transfer_failures_total"))


def _timed(pool: ThreadPoolExecutor, fn: Any, *args: Any, **kw: Any) -> Future[Any]:
    """`fn(*args)` in `pool`; its result is (seconds from now, result)."""
    start = time.monotonic()
    return pool.submit(lambda: (fn(*args, **kw), time.monotonic() - start))


def _survivors_serve(fleet: Fleet, url: str | None = None) -> None:
    """The survivors hold nothing once idle, and a fresh hand-off through them succeeds."""
    for name in ("p0", "d0"):
        wait_idle(fleet[name])
    prompt = prompt_ids(next(_FRESH))
    params = prefill_step(fleet["p0"], prompt)
    assert len(tokens(decode_step(fleet["d0"], prompt, params))) == 8
    if url is not None:
        assert len(tokens(complete(url, "a fresh request after the fault"))) == 8


def test_prefill_core_killed(fleet: Fleet) -> None:
    """kill -9 of a prefill engine's EngineCore: the request it was computing fails with a 503
    at once, the pull it was serving and the leases it held fall back to recompute on the
    decode engine with the right tokens, a stream already pulled finishes, and its API server
    exits 1."""
    victim, d0 = fleet["pv_core"], fleet["d0"]
    a, b, c, d = (prompt_ids(i) for i in range(1, 5))
    want = {i: tokens(complete(fleet["p0"].url, p)) for i, p in enumerate((a, b, c, d))}
    params_b, params_d = prefill_step(victim, b), prefill_step(victim, d)
    stream_c = open_stream(d0.url, c, 200, kv_transfer_params=prefill_step(victim, c))
    stream_c.read(2)
    core = stop_core(fleet, "pv_core")
    with ThreadPoolExecutor(4) as pool:
        pull_d = _timed(pool, decode_step, d0, d, params_d)  # its pull meets a stopped peer
        answer_a = _timed(
            pool,
            complete,
            victim.url,
            a,
            max_tokens=1,
            kv_transfer_params={"do_remote_decode": True},
        )
        time.sleep(0.5)
        core.signal(signal.SIGKILL)
        killed = time.monotonic()
        (r_a, t_a), (r_d, t_d) = answer_a.result(), pull_d.result()
        r_b, t_b = _timed(pool, decode_step, d0, b, params_b).result()
        kind, ids = stream_c.finish()
        t_c = time.monotonic() - killed
    assert r_a.status_code == 503 and "died" in r_a.json()["error"]["message"], r_a.text
    record("prefill EngineCore kill -9", "before the prefill answer", "503 engine dead", t_a)
    assert tokens(r_d) == want[3]
    assert t_d < LOAD_TIMEOUT + 2
    record("prefill EngineCore kill -9", "during the pull (peer stopped)", "recomputed, 200", t_d)
    assert tokens(r_b) == want[1]
    record("prefill EngineCore kill -9", "between answer and pull", "recomputed, 200", t_b)
    assert kind == "done" and len(ids) == 200
    record("prefill EngineCore kill -9", "mid-stream (pulled)", "stream completes", t_c)
    assert victim.proc.wait(10) == 1
    record("prefill EngineCore kill -9", "API server exit", "exit 1", time.monotonic() - killed)
    assert d0.metrics()['baton:kv_transfer_failures_total{reason="CONNECT_FAILED"}'] >= 1
    _survivors_serve(fleet)


def test_prefill_server_killed(fleet: Fleet, make_router: Any) -> None:
    """kill -9 of a prefill engine's API server (its core orphaned): a request the router had
    sent it is served by the decode engine alone (counted as a fallback), a client streaming
    from it sees a broken connection, a stream already pulled finishes, the orphaned core
    exits within a second or so although it was busy, and params it handed out end in a pull
    or a recompute."""
    victim, d0 = fleet["pv_server"], fleet["d0"]
    router = make_router([victim], [d0], "--on-no-prefill", "decode")
    a, b, c = (prompt_ids(i) for i in range(11, 14))
    want_a, want_b = (tokens(complete(fleet["p0"].url, p)) for p in (a, b))
    params_b = prefill_step(victim, b)
    stream_c = open_stream(d0.url, c, 200, kv_transfer_params=prefill_step(victim, c))
    stream_c.read(2)
    # --max-num-seqs 1: a long stream holds the victim, so the router's prefill step waits.
    # The victim's core is stopped from here to the kill, so the stream cannot end before it.
    blocker = open_stream(victim.url, prompt_ids(14), 900)
    blocker.read(1)
    core = stop_core(fleet, "pv_server")
    with ThreadPoolExecutor(2) as pool:
        via_router = _timed(pool, complete, router.url, a)
        deadline = time.monotonic() + 10
        while _router_in_flight(router.url, victim.url) < 1:
            assert time.monotonic() < deadline, "the router's prefill step never left"
            time.sleep(0.05)
        time.sleep(0.2)  # on its way to the victim's API server, which admits it
        victim.proc.kill()
        killed = time.monotonic()
        core.signal(signal.SIGCONT)  # an orphan now, busy with the stream
        orphan_exit = pool.submit(wait_exit, core, 30)
        r_a, t_a = via_router.result()
        kind, why = blocker.finish()
        t_blocker = time.monotonic() - killed
        kind_c, ids_c = stream_c.finish()
        t_c = time.monotonic() - killed
    assert tokens(r_a) == want_a
    record(
        "prefill API server kill -9",
        "before the prefill answer (via router)",
        "decode-only fallback, 200",
        t_a,
    )
    assert kind == "broken", (kind, why)
    record(
        "prefill API server kill -9",
        "mid-stream (client on the prefill engine)",
        f"connection broken ({why})",
        t_blocker,
    )
    assert kind_c == "done" and len(ids_c) == 200
    record("prefill API server kill -9", "mid-stream (pulled)", "stream completes", t_c)
    start = time.monotonic()
    r_b = decode_step(d0, b, params_b)
    assert tokens(r_b) == want_b
    record(
        "prefill API server kill -9",
        "between answer and pull",
        "pulled or recomputed, 200",
        time.monotonic() - start,
    )
    # The orphan had ~900 tokens left to compute for nobody; it stops at its next step.
    t_core = orphan_exit.result()
    assert t_core < 4, t_core
    record("prefill API server kill -9", "orphaned EngineCore (busy)", "exits by itself", t_core)
    fallbacks = httpx.get(f"{router.url}/metrics").text
    assert 'outcome="decode_only_fallback"' in fallbacks
    _survivors_serve(fleet, router.url)


def _router_in_flight(router_url: str, engine_url: str) -> float:
    """The router's open requests on one engine (`baton:router_in_flight`)."""
    prefix = f'baton:router_in_flight{{engine="{engine_url}",'
    for line in httpx.get(f"{router_url}/metrics", timeout=5).text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("target", ["server", "core"])
def test_decode_engine_killed(fleet: Fleet, make_router: Any, target: str) -> None:
    """kill -9 of a decode engine's API server or EngineCore: a client streaming through the
    router gets its whole answer, the stream moved to the other decode engine (the broken
    connection, or the engine's error event, starts the migration), never a hang;
    the prefill engine's leases (one mid-pull, one not yet pulled) end within the lease time;
    requests the router sends after the kill go to the other decode engine."""
    name = f"dv_{target}"
    victim, p0, d0 = fleet[name], fleet["p0"], fleet["d0"]
    router = make_router([p0], [victim, d0], "--decode-policy", "round-robin")
    streams = [open_stream(router.url, f"stream {i} of {target}", 900) for i in range(2)]
    for s in streams:
        s.read(2)
    on_victim = next(s for s in streams if s.engine == victim.url)
    survivor = next(s for s in streams if s.engine == d0.url)
    peer = BadKVPeer("stall")
    b, d = prompt_ids(21), prompt_ids(22)
    prefill_step(p0, b)  # a lease the victim will never pull
    params_d = resigned(prefill_step(p0, d), d, remote_port=peer.port, remote_ports=[peer.port])
    try:
        with ThreadPoolExecutor(2) as pool:
            pull = _timed(pool, decode_step, victim, d, params_d)
            deadline = time.monotonic() + 10
            while victim.metrics()["vllm:num_requests_waiting{}"] < 1:  # waits for its KV
                assert time.monotonic() < deadline, "the pull never started"
                time.sleep(0.05)
            # The victim's core stops until the kill, so its stream cannot end before it.
            core = stop_core(fleet, name)
            if target == "core":
                core.signal(signal.SIGKILL)
            else:
                victim.proc.kill()
            killed = time.monotonic()
            if target == "server":
                core.signal(signal.SIGCONT)  # an orphan now; it notices and exits
            try:
                r_d, _ = pull.result()
                pulled = f"HTTP {r_d.status_code}"
            except httpx.HTTPError as e:
                pulled = f"connection broken ({type(e).__name__})"
            t_d = time.monotonic() - killed
            kind, why = on_victim.finish()
            t_stream = time.monotonic() - killed
            after = [_timed(pool, complete, router.url, f"after {i}") for i in range(3)]
            answers = [f.result() for f in after]
    finally:
        peer.close()
    fault = f"decode {'EngineCore' if target == 'core' else 'API server'} kill -9"
    assert kind == "done", (kind, why)
    whole = tokens(complete(d0.url, on_victim.payload["prompt"], 60, max_tokens=900))
    assert why == whole, "the migrated stream differs from the single engine's answer"
    record(fault, "mid-stream (via router)", "migrated to the other decode engine, completes, "
           "right tokens", t_stream)  # fmt: skip
    assert pulled != "HTTP 200"
    record(fault, "during the pull (stalled peer)", pulled, t_d)
    assert [r.status_code for r, _ in answers] == [200, 200, 200], [r.text for r, _ in answers]
    record(
        fault,
        "new requests via router",
        "retried on the other decode, 200",
        max(t for _, t in answers),
    )
    survivor.read(5)  # unharmed; its client then leaves, which the engine sees as an abort
    survivor.close()
    start = time.monotonic()
    wait_idle(p0)
    record(
        fault,
        "between answer and pull (lease on prefill)",
        "lease expired, blocks freed",
        time.monotonic() - start + t_d,
    )
    if target == "core":
        assert victim.proc.wait(10) == 1
    wait_exit(fleet.cores[name], 10)
    _survivors_serve(fleet, router.url)


def test_router_killed(fleet: Fleet, make_router: Any) -> None:
    """kill -9 of the router: its clients see a broken connection at once (mid-stream), the
    engines abort what it had sent them (a prefill step not yet answered, a decode step whose
    engine was stopped), no block or lease is left once idle, and a new router serves."""
    p0, d0 = fleet["p0"], fleet["d0"]
    router = make_router([p0], [d0])
    streams = [open_stream(router.url, f"router stream {i}", 600) for i in range(3)]
    for s in streams:
        s.read(2)
    # Both engines' cores stop: the streams cannot run to their end before the kill, and the
    # next prefill step gets no answer before it.
    cores = [stop_core(fleet, "d0"), stop_core(fleet, "p0")]
    with ThreadPoolExecutor(1) as pool:
        pending = _timed(pool, complete, router.url, "never answered before the kill")
        time.sleep(0.5)
        router.proc.kill()
        killed = time.monotonic()
        for core in cores:
            core.signal(signal.SIGCONT)
        try:
            pending.result()
            outcome = "answered"
        except httpx.HTTPError as e:
            outcome = f"connection broken ({type(e).__name__})"
        t_pending = time.monotonic() - killed
    assert outcome.startswith("connection broken")
    record("router kill -9", "before the prefill answer", outcome, t_pending)
    results = [s.finish() for s in streams]
    t_streams = time.monotonic() - killed
    assert all(kind == "broken" for kind, _ in results), results
    record("router kill -9", "mid-stream", "connection broken", t_streams)
    t_idle = max(wait_idle(p0), wait_idle(d0)) + time.monotonic() - killed
    record("router kill -9", "engines after", "aborted, nothing leaked", t_idle)
    router2 = make_router([p0], [d0])
    _survivors_serve(fleet, router2.url)


class _CuttingProxy:
    """Forwards KV connections to a real KV server and cuts each one: `reset` at once, `reply`
    after half of the server's reply."""

    def __init__(self, target: int, mode: str) -> None:
        self.target, self.mode = target, mode
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            while True:
                conn, _ = self.sock.accept()
                threading.Thread(target=self._one, args=(conn,), daemon=True).start()
        except OSError:
            pass

    def _one(self, conn: socket.socket) -> None:
        if self.mode == "reset":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            conn.close()
            return
        up = socket.create_connection(("127.0.0.1", self.target))
        try:
            conn.settimeout(5)
            up.settimeout(5)
            conn.sendall(up.recv(GREETING.size, socket.MSG_WAITALL))  # the server speaks first
            up.sendall(conn.recv(1 << 16))
            reply = b""
            while len(reply) < 64:
                more = up.recv(1 << 16)
                if not more:
                    break
                reply += more
            conn.sendall(reply[: len(reply) // 2])
        except OSError:
            pass
        finally:
            up.close()
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("mode", ["reset", "reply"])
def test_connection_between_engines_cut(fleet: Fleet, mode: str) -> None:
    """The KV connection between decode and prefill is reset on connect, or cut halfway
    through the reply: the decode engine recomputes the right tokens within the load timeout,
    and the real prefill engine's lease ends (released or expired), leaking nothing."""
    p0, d0 = fleet["p0"], fleet["d0"]
    prompt = prompt_ids(31 if mode == "reset" else 32)
    want = tokens(complete(p0.url, prompt))  # not d0: a cached prompt is not pulled
    failures = _failures(d0)
    params = prefill_step(p0, prompt)
    proxy = _CuttingProxy(params["remote_port"], mode)
    try:
        start = time.monotonic()
        r = decode_step(
            d0, prompt, resigned(params, prompt, remote_port=proxy.port, remote_ports=[proxy.port])
        )
        took = time.monotonic() - start
    finally:
        proxy.close()
    assert tokens(r) == want and took < LOAD_TIMEOUT + 2
    assert _failures(d0) > failures
    t_idle = wait_idle(p0) + took
    moment = {"reset": "reset on connect", "reply": "cut mid-reply"}[mode]
    record("KV connection cut", moment, "recomputed, 200; lease freed", t_idle)
    _survivors_serve(fleet)


def test_small_decode_pool_preempts_and_completes(fleet: Fleet) -> None:
    """A decode engine with 24 blocks of 8 tokens takes 4 hand-offs that need about 60 blocks:
    it preempts, every request still completes with the tokens the big engine gives, and the
    pool is empty once idle."""
    small, p0, d0 = fleet["d_small"], fleet["p0"], fleet["d0"]
    prompts = [prompt_ids(40 + i, 30) for i in range(4)]
    want = [tokens(complete(d0.url, p, max_tokens=60)) for p in prompts]
    before = small.metrics()["vllm:num_preemptions_total{}"]

    def hand_off(prompt: list[int]) -> list[int]:
        return tokens(decode_step(small, prompt, prefill_step(p0, prompt), max_tokens=60))

    start = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(hand_off, prompts))
    took = time.monotonic() - start
    assert got == want
    assert small.metrics()["vllm:num_preemptions_total{}"] > before
    t_idle = wait_idle(small) + took
    record(
        "decode KV pool too small (24 blocks)",
        "4 concurrent hand-offs",
        "preempted, all complete and equal",
        t_idle,
    )
    _survivors_serve(fleet)
