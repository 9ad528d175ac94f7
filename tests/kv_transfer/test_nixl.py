"""The NIXL transport: leases READ between two agents (in one process, and across two processes),
with every refusal, the expiry rules, release, deadlines and the checksum check of what arrived."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import pytest
import torch

from baton.kv_transfer.base import KVTransferConfig, LoadSpec, TransferResult
from baton.kv_transfer.checksum import SUM64, XXH3
from baton.kv_transfer.keyring import KeyRing, new_secret
from baton.kv_transfer.leases import Status
from baton.kv_transfer.nixl import channel as nixl_channel
from baton.kv_transfer.params import RemotePrefill
from tests.kv_transfer.helpers import as_bytes, make_cache
from tests.support.kv_wire import KEYS, side_call

KID = KEYS.signing_key_id

nixl = pytest.importorskip(
    "baton.kv_transfer.nixl.transport",
    reason="no NIXL package is installed (pip install nixl-cu12)",
    exc_type=ImportError,
)
NixlTransport = nixl.NixlTransport


def _transport(cache: torch.Tensor, port: int = 0) -> Any:
    t = NixlTransport(KVTransferConfig(role="both", transport="nixl", port=port), KEYS)
    t.port = t.start(cache)
    return t


@pytest.fixture
def pair() -> Iterator[tuple[Any, Any, torch.Tensor, torch.Tensor]]:
    """A serving transport over a random cache and a reading one over a zeroed cache."""
    served, local = make_cache(seed=1), torch.zeros_like(make_cache())
    server, reader = _transport(served), _transport(local)
    yield server, reader, served, local
    server.stop()
    reader.stop()


def _remote(server: Any, request_id: str, ids: list[int], engine: str | None = None) -> Any:
    engine = engine or server.config.engine_id
    expires = time.time() + 30
    return RemotePrefill(
        engine, "127.0.0.1", server.port, request_id, ids, len(ids) * 4, expires, key_id=KID
    )


def _read(
    reader: Any, remote: RemotePrefill, local_ids: list[int], seconds: float = 5.0
) -> TransferResult:
    spec = LoadSpec("d", remote, remote.block_ids, local_ids, seconds)
    return reader.read(spec, time.monotonic() + seconds)  # type: ignore[no-any-return]


def _finished(server: Any, timeout: float = 2.0) -> tuple[list[str], list[str]]:
    """The server's (claimed, expired) leases once one has ended: a Done is one-way, so it may
    still be on its way when the reader returns."""
    end = time.monotonic() + timeout
    while True:
        finished = server.finished_leases(time.time())
        if finished != ([], []) or time.monotonic() > end:
            return finished  # type: ignore[no-any-return]
        time.sleep(0.005)


def test_read_copies_leased_blocks_and_claims_the_lease(pair: Any) -> None:
    """Leased blocks, in runs and out of order, land in the reader's blocks byte for byte; the
    lease is reported claimed once, and a second read of it is refused."""
    server, reader, served, local = pair
    remote_ids, local_ids = [3, 4, 5, 9, 0], [6, 7, 8, 1, 11]
    server.lease("r1", remote_ids, time.time() + 30)
    result = _read(reader, _remote(server, "r1", remote_ids), local_ids)
    assert result.ok, result.error
    assert result.num_bytes == len(remote_ids) * served[0].numel() * 4
    assert torch.equal(as_bytes(local[local_ids]), as_bytes(served[remote_ids]))
    assert _finished(server) == (["r1"], [])
    again = _read(reader, _remote(server, "r1", remote_ids), local_ids)
    assert not again.ok and again.reason == "UNKNOWN_REQUEST"


def test_paired_runs_coalesce_only_where_both_sides_are_consecutive() -> None:
    """One descriptor per run of ids consecutive on both sides."""
    assert nixl_channel.paired_runs([3, 4, 5, 9, 10], [0, 1, 7, 8, 9]) == [
        (3, 0, 2),
        (5, 7, 1),
        (9, 8, 2),
    ]


def test_split_runs_cuts_runs_into_chunks_in_order() -> None:
    """Chunks hold at most the given number of blocks and keep the runs' order."""
    chunks = nixl_channel.split_runs([(10, 0, 5), (20, 9, 2)], 3)
    assert chunks == [[(10, 0, 3)], [(13, 3, 2), (20, 9, 1)], [(21, 10, 1)]]


@pytest.mark.parametrize("checksum", [XXH3, SUM64])
def test_a_read_of_many_chunks_arrives_and_checks_every_chunk(
    monkeypatch: pytest.MonkeyPatch, checksum: str
) -> None:
    """A read larger than one chunk lands whole; a changed block in a later chunk is caught.
    With sum64 (what a server with its cache in device memory names) the reader computes the
    server's kind of checksum, not its own."""
    shape = (300, 1, 2, 2, 1, 8)  # 128 B blocks
    monkeypatch.setattr(nixl, "_CHUNK_BYTES", 64 * 128)  # 64 blocks a chunk: 4 chunks here
    monkeypatch.setattr(nixl, "kind_for", lambda kv: checksum)
    served, local = make_cache(seed=4, shape=shape), torch.zeros_like(make_cache(shape=shape))
    server, reader = _transport(served), _transport(local)
    try:
        remote_ids, local_ids = list(range(10, 210)), list(range(299, 99, -1))
        server.lease("big", remote_ids, time.time() + 30)
        result = _read(reader, _remote(server, "big", remote_ids), local_ids)
        assert result.ok, result.error
        assert torch.equal(as_bytes(local[local_ids]), as_bytes(served[remote_ids]))
        assert server._hello.checksum == checksum
        server.lease("bad", remote_ids, time.time() + 30)
        server._leases._leases["bad"].crcs.result(timeout=5)
        served[150].view(torch.uint8).view(-1)[0] ^= 1
        bad = _read(reader, _remote(server, "bad", remote_ids), local_ids)
        assert not bad.ok and bad.reason == "CHECKSUM_MISMATCH"
        assert "remote block 150" in (bad.error or "")
    finally:
        server.stop()
        reader.stop()


def test_a_subset_of_the_lease_can_be_read(pair: Any) -> None:
    """A reader that caches a prefix reads only the rest of the leased blocks."""
    server, reader, served, local = pair
    server.lease("r", [1, 2, 3, 4], time.time() + 30)
    result = _read(reader, _remote(server, "r", [3, 4]), [5, 6])
    assert result.ok, result.error
    assert torch.equal(as_bytes(local[[5, 6]]), as_bytes(served[[3, 4]]))


def test_unknown_engine_is_refused_and_a_restarted_engine_replaces_the_cached_agent() -> None:
    """A wrong engine id reads nothing (UNKNOWN_ENGINE); a new engine at the same address is
    read through a new remote agent, with the old one dropped."""
    local = torch.zeros_like(make_cache())
    reader, first = _transport(local), _transport(make_cache(seed=2))
    port = first.port
    try:
        first.lease("r", [1], time.time() + 30)
        assert _read(reader, _remote(first, "r", [1]), [0]).ok
        old = reader._peers[("127.0.0.1", port)].agent_name
        bad = _read(reader, _remote(first, "r", [1], engine="someone-else"), [0])
        assert not bad.ok and bad.reason == "UNKNOWN_ENGINE" and bad.num_bytes == 0
        first.stop()
        second = _transport(make_cache(seed=3), port=port)  # the restarted engine
        try:
            second.lease("r", [2], time.time() + 30)
            stale = _read(reader, _remote(first, "r", [2]), [4])
            assert not stale.ok and stale.reason == "UNKNOWN_ENGINE"
            assert ("127.0.0.1", port) not in reader._peers  # the old agent is gone
            fresh = _read(reader, _remote(second, "r", [2]), [4])
            assert fresh.ok, fresh.error
            assert reader._peers[("127.0.0.1", port)].agent_name != old
            assert torch.equal(as_bytes(local[4]), as_bytes(make_cache(seed=3)[2]))
        finally:
            second.stop()
    finally:
        first.stop()
        reader.stop()


def test_expired_lease_is_refused_and_reported(pair: Any) -> None:
    """A lease past its time is refused (EXPIRED) before and after the engine's sweep drops it."""
    server, reader, _, _ = pair
    server.lease("old", [1, 2], time.time() - 1)
    first = _read(reader, _remote(server, "old", [1, 2]), [1, 2])
    assert not first.ok and first.reason == "EXPIRED"
    assert server.finished_leases(time.time()) == ([], ["old"])
    late = _read(reader, _remote(server, "old", [1, 2]), [1, 2])
    assert not late.ok and late.reason == "EXPIRED"


def test_bad_blocks_are_refused(pair: Any) -> None:
    """Asking for a block outside the lease is refused (BAD_BLOCKS) and reads nothing."""
    server, reader, _, local = pair
    server.lease("r", [1, 2], time.time() + 30)
    result = _read(reader, _remote(server, "r", [1, 3]), [1, 2])
    assert not result.ok and result.reason == "BAD_BLOCKS"
    assert not local.any()


def test_a_lease_under_a_read_is_not_expired_until_done(pair: Any) -> None:
    """Between a reader's Lookup and its Done the lease outlives its time; Done claims it."""
    server, _, _, _ = pair
    engine = server.config.engine_id
    server.lease("r", [1], time.time() + 1.0)
    reply = side_call(
        server.port, nixl_channel.Lookup(engine, "r", [1], server._hello.block_bytes, 5.0)
    )
    assert reply.status == Status.OK and len(reply.crcs) == 1
    time.sleep(1.2)
    assert server.finished_leases(time.time()) == ([], [])
    side_call(server.port, nixl_channel.Done(engine, "r"))
    assert _finished(server) == (["r"], [])


def test_release_remote_frees_the_lease_at_once(pair: Any) -> None:
    """release_remote makes the server report the lease claimed; releasing again is harmless."""
    server, reader, _, _ = pair
    server.lease("r", [1, 2], time.time() + 30)
    reader.release_remote(_remote(server, "r", [1, 2]), time.monotonic() + 2)
    assert server.finished_leases(time.time()) == (["r"], [])
    reader.release_remote(_remote(server, "r", [1, 2]), time.monotonic() + 2)
    reader.release_remote(_remote(server, "r", [1, 2], engine="gone"), time.monotonic() + 2)


def test_stalled_side_channel_fails_at_the_deadline() -> None:
    """A peer that accepts and never answers: the read returns DEADLINE at its deadline."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(listener.accept()[0]), daemon=True).start()
    reader = _transport(torch.zeros_like(make_cache()))
    try:
        remote = RemotePrefill("e", "127.0.0.1", port, "r", [1], 4, time.time() + 30, key_id=KID)
        start = time.monotonic()
        result = _read(reader, remote, [1], seconds=0.5)
        assert not result.ok and result.reason == "DEADLINE"
        assert 0.4 < time.monotonic() - start < 1.5
    finally:
        reader.stop()
        listener.close()
        for conn in held:
            conn.close()


def test_nothing_listening_is_connect_failed() -> None:
    """Params pointing where nobody listens fail fast with CONNECT_FAILED."""
    reader = _transport(torch.zeros_like(make_cache()))
    try:
        remote = RemotePrefill("e", "127.0.0.1", 9, "r", [1], 4, time.time() + 30, key_id=KID)
        result = _read(reader, remote, [1], seconds=2)
        assert not result.ok and result.reason == "CONNECT_FAILED" and result.seconds < 1
    finally:
        reader.stop()


def test_block_changed_after_the_lease_is_a_checksum_mismatch(pair: Any) -> None:
    """Served bytes that differ from what was leased fail the checksum of what was READ."""
    server, reader, served, _ = pair
    server.lease("r", [2, 3], time.time() + 30)
    server._leases._leases["r"].crcs.result(timeout=5)  # the lease-time checksums exist
    served[3].view(torch.uint8).view(-1)[100] ^= 0xFF
    result = _read(reader, _remote(server, "r", [2, 3]), [2, 3])
    assert not result.ok and result.reason == "CHECKSUM_MISMATCH"
    assert "remote block 3" in (result.error or "")
    assert server.finished_leases(time.time()) == ([], [])  # no Done for bad bytes


def test_concurrent_reads_all_arrive(pair: Any) -> None:
    """Four loader threads reading different leases at once each get their own blocks."""
    server, reader, served, local = pair
    for i in range(4):
        server.lease(f"r{i}", [i * 3, i * 3 + 1, i * 3 + 2], time.time() + 30)

    def one(i: int) -> TransferResult:
        ids = [i * 3, i * 3 + 1, i * 3 + 2]
        return _read(reader, _remote(server, f"r{i}", ids), ids[::-1])

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    assert all(r.ok for r in results), [r.error for r in results]
    for i in range(4):
        ids = [i * 3, i * 3 + 1, i * 3 + 2]
        assert torch.equal(as_bytes(local[ids[::-1]]), as_bytes(served[ids]))


def test_stop_joins_its_threads_quickly() -> None:
    """stop() returns well within a second, with a reader connected, and leaves no thread."""
    server = _transport(make_cache())
    reader = _transport(torch.zeros_like(make_cache()))
    server.lease("r", [1], time.time() + 30)
    assert _read(reader, _remote(server, "r", [1]), [1]).ok
    start = time.monotonic()
    server.stop()
    reader.stop()
    assert time.monotonic() - start < 1.0
    names = {t.name for t in threading.enumerate()}
    assert not [n for n in names if n.startswith("kv-nixl")]


def test_make_transport_picks_nixl() -> None:
    """--kv-transport nixl gives the NIXL transport when the package imports."""
    from baton.kv_transfer.connector import make_transport

    assert make_transport(KVTransferConfig(transport="nixl"), KEYS).name == "nixl"


def _serve_in_child(ports: Any, stop: Any) -> None:
    server = _transport(make_cache(seed=5))
    server.lease("x", [2, 3, 4, 7], time.time() + 60)
    ports.put((server.port, server.config.engine_id))
    stop.wait(30)
    ports.put(_finished(server, 5))
    server.stop()


def test_read_from_another_process() -> None:
    """A lease served by another process is READ byte for byte and claimed there."""
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_serve_in_child, args=(ports, stop), daemon=True)
    child.start()
    local = torch.zeros_like(make_cache())
    reader = _transport(local)
    try:
        port, engine = ports.get(timeout=60)
        expires = time.time() + 30
        remote = RemotePrefill(
            engine, "127.0.0.1", port, "x", [2, 3, 4, 7], 16, expires, key_id=KID
        )
        result = _read(reader, remote, [0, 1, 2, 3])
        assert result.ok, result.error
        assert torch.equal(as_bytes(local[:4]), as_bytes(make_cache(seed=5)[[2, 3, 4, 7]]))
        stop.set()
        assert ports.get(timeout=10) == (["x"], [])
    finally:
        stop.set()
        reader.stop()
        child.join(10)
        if child.is_alive():
            child.kill()


def test_a_reader_without_the_key_gets_no_agent_and_no_blocks(pair: Any) -> None:
    """A NIXL reader holding another service's key is refused at Hello: it never learns the
    serving agent's metadata (with which it could READ the registered memory), reads nothing,
    and the lease waits for the rightful reader."""
    server, _, _, _ = pair
    local = torch.zeros_like(make_cache())
    other = KeyRing(new_secret(), "another service's key")
    stranger = NixlTransport(KVTransferConfig(role="both", transport="nixl"), other)
    stranger.start(local)
    try:
        server.lease("r", [1, 2], time.time() + 30)
        remote = msgspec.structs.replace(_remote(server, "r", [1, 2]), key_id=other.signing_key_id)
        result = _read(stranger, remote, [1, 2])
        assert not result.ok and result.reason == "UNAUTHORIZED", result.error
        assert stranger._peers == {} and not local.any()
        assert server.finished_leases(time.time()) == ([], [])
    finally:
        stranger.stop()
