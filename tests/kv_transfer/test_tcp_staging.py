"""Tests for TCP transfers staged through host buffers (the device-memory path, forced on a host
cache): byte-exact blocks across chunks and processes, torn or short chunks detected, and
disaggregated engines with staging forced answering as one engine does."""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import queue
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest
import torch

from baton.engine.api.cli import add_server_args, configs_from_args
from baton.kv_transfer.base import KVTransferConfig
from baton.kv_transfer.checksum import block_bytes
from baton.kv_transfer.tcp.reader import read_blocks
from baton.kv_transfer.tcp.server import KVBlockServer
from baton.kv_transfer.tcp.staging import Stager, StagingPool, plan_chunks, uses_staging
from tests.kv_transfer.helpers import ENGINE, SHAPE, as_bytes, deadline, make_cache, wait_done
from tests.kv_transfer.test_connector_core import (
    GREEDY,
    _drain,
    _engine,
    _hand_off,
    _prompts,
    _request,
    _run,
    transfers,
)
from tests.support.kv_peers import BadKVPeer
from tests.support.kv_wire import KEYS, lease_at

# 40 blocks of 1 KiB (float32 SHAPE blocks have 1 KiB): chunks of 3 blocks make several chunks
# per run and reuse both buffers many times.
BIG = (40, *SHAPE[1:])
CHUNK = 3 * 1024


def _server(cache: torch.Tensor, chunk: int | None = CHUNK) -> KVBlockServer:
    """A block server, staged through chunks of ``chunk`` bytes (None: straight from memory)."""
    pool = None if chunk is None else StagingPool(cache, chunk)
    srv = KVBlockServer(cache, ENGINE, KEYS, staging=pool)
    srv.start()
    return srv


@pytest.mark.parametrize(
    ("ids", "per_chunk", "chunks"),
    [
        ([], 2, []),
        ([4, 5, 6, 7, 8], 2, [[(4, 2)], [(6, 2)], [(8, 1)]]),
        ([1, 3, 4, 9], 3, [[(1, 1), (3, 2)], [(9, 1)]]),
        ([7, 6, 5], 8, [[(7, 1), (6, 1), (5, 1)]]),
    ],
)
def test_plan_chunks(ids: list[int], per_chunk: int, chunks: list[list[tuple[int, int]]]) -> None:
    """Ids keep their order and are cut into chunks of at most per_chunk blocks, as runs."""
    assert plan_chunks(ids, per_chunk) == chunks


def test_staging_modes() -> None:
    """auto stages only a cache outside host memory; always stages a host cache too; anything
    else is refused, by the config and by the engine flag."""
    host = torch.zeros(SHAPE)
    assert not uses_staging(host, "auto")
    assert uses_staging(host, "always")
    assert uses_staging(torch.empty(SHAPE, device="meta"), "auto")
    with pytest.raises(ValueError, match="kv staging"):
        KVTransferConfig(staging="never")
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = ["--model", "m", "--role", "decode", "--kv-staging", "always"]
    engine, _ = configs_from_args(parser.parse_args(args))
    assert engine.kv_transfer is not None and engine.kv_transfer.staging == "always"
    engine, _ = configs_from_args(parser.parse_args(args[:4]))
    assert engine.kv_transfer is not None and engine.kv_transfer.staging == "auto"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize(
    ("server_chunk", "reader_chunk"),
    [(CHUNK, CHUNK), (CHUNK, None), (None, 2 * 1024), (1024, 1 << 20)],
    ids=["both-staged", "server-staged", "reader-staged", "block-chunks-vs-one-chunk"],
)
@pytest.mark.parametrize(
    ("remote_ids", "local_ids"),
    [
        ([3], [39]),
        (list(range(10, 30)), list(range(0, 20))),
        ([1, 5, 6, 7, 8, 9, 30, 2], [38, 0, 1, 2, 20, 21, 22, 3]),
        (list(range(40)), list(reversed(range(40)))),
    ],
    ids=["one", "one-run", "scattered", "all-reversed"],
)
def test_staged_round_trip_byte_exact(
    dtype: torch.dtype,
    server_chunk: int | None,
    reader_chunk: int | None,
    remote_ids: list[int],
    local_ids: list[int],
) -> None:
    """Blocks land byte-exact (checksums matching) whichever side stages, in chunks of one block,
    of several, or of the whole read; every other local block is kept."""
    remote = make_cache(dtype, seed=1, shape=BIG)
    local = make_cache(dtype, seed=2, shape=BIG)
    before = local.clone()
    srv = _server(remote, server_chunk)
    pool = None if reader_chunk is None else StagingPool(local, reader_chunk)
    try:
        srv.leases.lease("r", remote_ids, time.time() + 30)
        result = read_blocks(
            lease_at(srv.port, ENGINE, "r"), remote_ids, local, local_ids, deadline(), staging=pool
        )
        assert result.ok, result.error
        assert result.num_bytes == len(remote_ids) * block_bytes(remote)
        assert torch.equal(as_bytes(local[local_ids]), as_bytes(remote[remote_ids]))
        untouched = [b for b in range(BIG[0]) if b not in local_ids]
        assert torch.equal(as_bytes(local[untouched]), as_bytes(before[untouched]))
        assert wait_done(srv) == ["r"]
    finally:
        srv.stop()
        if pool is not None:
            pool.close()


def test_stagers_are_reused_by_consecutive_reads() -> None:
    """Reads one after another on one pool reuse its stager, and stale bytes of an earlier read
    never leak into a later one."""
    remote = make_cache(seed=3, shape=BIG)
    srv = _server(remote)
    local = torch.zeros(BIG)
    pool = StagingPool(local, CHUNK)
    try:
        for i, ids in enumerate([list(range(0, 12)), [20, 21], list(range(25, 32))]):
            srv.leases.lease(f"r{i}", ids, time.time() + 30)
            dst = list(range(len(ids)))
            result = read_blocks(
                lease_at(srv.port, ENGINE, f"r{i}"), ids, local, dst, deadline(), staging=pool
            )
            assert result.ok, result.error
            assert torch.equal(as_bytes(local[dst]), as_bytes(remote[ids]))
        assert len(pool._idle) == 1
    finally:
        srv.stop()
        pool.close()


def _serve_staged_in_child(port_q: mp.Queue, stop: mp.Event, done_q: mp.Queue) -> None:
    cache = make_cache(torch.bfloat16, seed=7, shape=BIG)
    pool = StagingPool(cache, CHUNK)
    srv = KVBlockServer(cache, "child-engine", KEYS, staging=pool)
    srv.leases.lease("x", [2, 3, 4, 8, 9, 10, 11, 12, 30], time.time() + 30)
    port_q.put(srv.start())
    stop.wait(20)
    done_q.put(wait_done(srv, 5))
    srv.stop()
    pool.close()


def _started(port_q: mp.Queue, proc: BaseProcess) -> int:
    """The port the spawned server put on `port_q`. A spawned child imports torch and this
    module again before it serves: on a loaded 2-core machine that took over 30 s once, so this
    waits as long as the child lives (up to 120 s), and fails at once if it died."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            return int(port_q.get(timeout=1))
        assert proc.is_alive(), f"the server's process exited with {proc.exitcode}"
    raise AssertionError("the server's process did not start serving within 120 s")


def test_staged_round_trip_across_processes() -> None:
    """A staged server in a spawned process serves its blocks to a staged reader in this one."""
    ctx = mp.get_context("spawn")
    port_q, done_q, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_serve_staged_in_child, args=(port_q, stop, done_q), daemon=True)
    proc.start()
    local = torch.zeros(BIG, dtype=torch.bfloat16)
    pool = StagingPool(local, 2 * 1024 // 2)  # bf16 blocks are 512 B: chunks of two
    try:
        port = _started(port_q, proc)
        ids, dst = [2, 3, 4, 8, 9, 10, 11, 12, 30], [0, 1, 5, 6, 7, 20, 21, 22, 39]
        result = read_blocks(
            lease_at(port, "child-engine", "x"), ids, local, dst, deadline(), staging=pool
        )
        assert result.ok, result.error
        expected = make_cache(torch.bfloat16, seed=7, shape=BIG)
        assert torch.equal(as_bytes(local[dst]), as_bytes(expected[ids]))
        stop.set()
        assert done_q.get(timeout=10) == ["x"]
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        pool.close()


@pytest.fixture
def torn_load(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Makes the sender's copy into its staging buffer tear on the second chunk (one byte
    flipped after the copy, as a copy racing a write would leave it); yields the chunks loaded."""
    loads: list[int] = []
    original: Callable[..., Callable[[], None]] = Stager._load

    def load(self: Stager, i: int, runs: list[tuple[int, int]]) -> Callable[[], None]:
        wait = original(self, i, runs)
        loads.append(i)
        if len(loads) == 2:
            wait()
            self._bufs[i][0, 17] ^= 0xFF
            return lambda: None
        return wait

    monkeypatch.setattr(Stager, "_load", load)
    yield loads


@pytest.mark.parametrize("reader_staged", [True, False])
def test_torn_staged_chunk_is_detected(torn_load: list[int], reader_staged: bool) -> None:
    """A staged chunk torn on the sender fails the reader's checksum (CHECKSUM_MISMATCH), the
    reader sends no DONE, and the lease stays unclaimed for a retry or its expiry."""
    remote = make_cache(seed=4, shape=BIG)
    srv = _server(remote)
    local = torch.zeros(BIG)
    pool = StagingPool(local, CHUNK) if reader_staged else None
    try:
        srv.leases.lease("r", list(range(12)), time.time() + 30)
        lease = lease_at(srv.port, ENGINE, "r")
        result = read_blocks(
            lease, list(range(12)), local, list(range(12)), deadline(), staging=pool
        )
        assert len(torn_load) >= 2
        assert not result.ok and result.error is not None
        assert result.reason == "CHECKSUM_MISMATCH", result.error
        assert wait_done(srv, 0.3) == []
        # The next read (no tear now) delivers every byte.
        result = read_blocks(
            lease, list(range(12)), local, list(range(12)), deadline(), staging=pool
        )
        assert result.ok, result.error
        assert torch.equal(as_bytes(local[:12]), as_bytes(remote[:12]))
    finally:
        srv.stop()
        if pool is not None:
            pool.close()


@pytest.mark.parametrize(
    ("mode", "reason"),
    [("corrupt", "CHECKSUM_MISMATCH"), ("short", "SHORT_READ"), ("stall", "DEADLINE")],
)
def test_staged_reader_detects_bad_peers(mode: str, reason: str) -> None:
    """A staged reader fails a peer's wrong bytes, short payload or silence as a result, by its
    deadline, and leaves its stager free for the next read."""
    peer = BadKVPeer(mode)
    local = torch.zeros(BIG)
    pool = StagingPool(local, CHUNK)
    try:
        start = time.monotonic()
        result = read_blocks(
            lease_at(peer.port, ENGINE, "r"),
            list(range(10)),
            local,
            list(range(10)),
            start + 1.0,
            staging=pool,
        )
        assert time.monotonic() < start + 2.0
        assert not result.ok and result.reason == reason, result.error
        if mode != "stall":
            assert len(pool._idle) == 1  # every copy ended and the stager went back
    finally:
        peer.close()
        pool.close()


@pytest.fixture(scope="module")
def model(tiny_model) -> Path:
    return tiny_model("llama")


def test_staged_disaggregated_equals_single_engine(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill and decode engines with --kv-staging always hand every prompt's KV through the
    staging buffers, and the decode engine's greedy tokens equal one engine's."""
    staged = {"send": 0, "receive": 0}
    send, receive = Stager.send, Stager.receive

    def counting_send(self: Stager, *a: object) -> None:
        staged["send"] += 1
        send(self, *a)  # type: ignore[arg-type]

    def counting_receive(self: Stager, *a: object) -> list[int]:
        staged["receive"] += 1
        return receive(self, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(Stager, "send", counting_send)
    monkeypatch.setattr(Stager, "receive", counting_receive)
    prompts = _prompts()
    single = _engine(model, None)
    want = _run(single, [_request(f"s{i}", ids, GREEDY) for i, ids in enumerate(prompts)])
    single.shutdown()
    prefill = _engine(model, "prefill", transport="tcp", staging="always")
    decode = _engine(model, "decode", transport="tcp", staging="always")
    try:
        _, got = _hand_off(prefill, decode, prompts)
        for i in range(len(prompts)):
            assert got[f"d{i}"].new_token_ids == want[f"s{i}"].new_token_ids, i
        results = transfers(decode)
        pulls = sum(len(p) > 1 for p in prompts)
        assert [r.ok for r in results].count(True) == pulls
        assert staged == {"send": pulls, "receive": pulls}
        _drain(prefill)
        assert prefill.scheduler.kv.usage() == 0.0
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.slow  # four worker processes
def test_staged_tp2_split_kv_heads_equals_single_engine(tiny_model) -> None:
    """tensor_parallel_size 2 with the KV heads split and staging forced: each decode rank pulls
    its shard through the staging buffers, and the answers equal one engine's."""
    path = tiny_model("llama")
    prompts = _prompts()
    single = _engine(path, None)
    want = _run(single, [_request(f"s{i}", ids, GREEDY) for i, ids in enumerate(prompts)])
    single.shutdown()
    prefill = _engine(path, "prefill", tp=2, transport="tcp", staging="always")
    try:
        decode = _engine(path, "decode", tp=2, transport="tcp", staging="always")
    except BaseException:
        prefill.shutdown()
        raise
    try:
        _, got = _hand_off(prefill, decode, prompts)
        for i in range(len(prompts)):
            assert got[f"d{i}"].new_token_ids == want[f"s{i}"].new_token_ids, i
        results = transfers(decode)
        assert all(r.ok for r in results), [r.error for r in results]
        assert len(results) == sum(len(p) > 1 for p in prompts)
        _drain(prefill)
        assert prefill.scheduler.kv.usage() == 0.0
    finally:
        prefill.shutdown()
        decode.shutdown()
