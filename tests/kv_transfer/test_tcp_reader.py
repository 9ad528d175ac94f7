"""The reader side of the TCP transport: the connection pool and the chunked checksum."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from baton.kv_transfer.checksum import block_checksum, combine
from baton.kv_transfer.leases import Status
from baton.kv_transfer.sockets import KVConnectionPool
from baton.kv_transfer.tcp.reader import RECV_CHUNK_BYTES, read_blocks
from baton.kv_transfer.tcp.server import KVBlockServer
from tests.kv_transfer.helpers import (
    BB,
    ENGINE,
    SHAPE,
    as_bytes,
    deadline,
    fake_server,
    make_cache,
    read,
)
from tests.support.kv_wire import KEYS, Request, greet, lease_at, read_request

# ---------------------------------------------------------------------- connection pool


def test_pool_reuses_one_connection(server: KVBlockServer) -> None:
    """Reads through a pool share one connection and stay byte-exact."""
    remote = make_cache()
    with KVConnectionPool() as pool:
        for i in range(3):
            server.leases.lease(f"r{i}", [i, i + 1], time.time() + 30)
            local = torch.zeros(SHAPE)
            result = read_blocks(
                lease_at(server.port, ENGINE, f"r{i}"),
                [i, i + 1],
                local,
                [0, 1],
                deadline(),
                pool=pool,
            )
            assert result.ok, result.error
            assert torch.equal(as_bytes(local[[0, 1]]), as_bytes(remote[[i, i + 1]]))
        assert pool.connects == 1


def test_pool_drops_broken_connection_and_reconnects() -> None:
    """A pooled connection the server closed is dropped; the next read reconnects and succeeds."""
    srv = KVBlockServer(make_cache(), ENGINE, KEYS, io_timeout=0.2)  # closes idle connections fast
    srv.start()
    try:
        with KVConnectionPool() as pool:
            srv.leases.lease("a", [0], time.time() + 30)
            assert read(srv, torch.zeros(SHAPE), "a", [0], [0], pool=pool).ok
            time.sleep(0.5)  # the server's io_timeout closes the idle pooled connection
            srv.leases.lease("b", [1], time.time() + 30)
            local = torch.zeros(SHAPE)
            result = read(srv, local, "b", [1], [0], pool=pool)
            assert result.ok, result.error
            assert torch.equal(as_bytes(local[0]), as_bytes(make_cache()[1]))
            assert pool.connects == 2
    finally:
        srv.stop()


def test_pool_drops_connection_after_error(server: KVBlockServer) -> None:
    """A connection whose read failed is never reused: the next read opens a new one."""
    with KVConnectionPool() as pool:
        failed = read(server, torch.zeros(SHAPE), "nobody", [0], [0], pool=pool)
        assert failed.error is not None and failed.error.startswith("UNKNOWN_REQUEST")
        server.leases.lease("r", [0], time.time() + 30)
        assert read(server, torch.zeros(SHAPE), "r", [0], [0], pool=pool).ok
        assert pool.connects == 2


def test_pool_reconnects_after_mid_read_failure() -> None:
    """A read that dies mid-payload on a pooled connection fails; the next one reconnects."""
    with KVConnectionPool() as pool:
        payload = bytes(range(256)) * (BB // 256)

        def behave(request: Request) -> None:
            _ok_reply(request, payload)
            request.conn.sendall(payload[: BB // 2])

        port, thread = fake_server(behave)
        result = read_blocks(
            lease_at(port, ENGINE, "r"), [0], torch.zeros(SHAPE), [0], deadline(), pool=pool
        )
        thread.join(2)
        assert result.error is not None and result.error.startswith("SHORT_READ")
        assert result.num_bytes == BB // 2
        assert pool.take("127.0.0.1", port) is None  # the broken connection was not kept


def test_pool_deadline_on_pooled_connection() -> None:
    """A pooled connection whose server goes silent still returns by the read's deadline."""
    stall = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    payload = bytes(range(256)) * (BB // 256)

    def run() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                nonce = greet(conn)
                for _ in range(2):
                    request = read_request(conn, nonce)
                    if stall.is_set():
                        time.sleep(2)  # the second read: accepts the request, never answers
                        return
                    _ok_reply(request, payload)
                    conn.sendall(payload)
                    conn.recv(1)
                    stall.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    with KVConnectionPool() as pool:
        first = read_blocks(
            lease_at(port, ENGINE, "a"), [0], torch.zeros(SHAPE), [0], deadline(), pool=pool
        )
        assert first.ok, first.error
        end = time.monotonic() + 0.3
        second = read_blocks(
            lease_at(port, ENGINE, "b"), [0], torch.zeros(SHAPE), [0], end, pool=pool
        )
        assert time.monotonic() < end + 0.5
        assert second.error is not None and second.error.startswith("DEADLINE")
        assert pool.connects == 1  # the stalled read was on the pooled connection
    thread.join(3)


# ---------------------------------------------------------------------- chunked checksum


def _ok_reply(request: Request, payload: bytes) -> None:
    crcs = [block_checksum(payload[i : i + BB]) for i in range(0, len(payload), BB)]
    request.reply(Status.OK, BB, len(payload), combine(crcs))


@pytest.mark.parametrize("where", ["first", "last"])
def test_corruption_in_first_or_last_chunk(where: str) -> None:
    """A flipped byte in the first or the last receive chunk of a multi-chunk read is caught."""
    num_blocks = 2 * (RECV_CHUNK_BYTES // BB) + 3  # two full chunks and a partial third
    shape = (num_blocks, *SHAPE[1:])
    payload = bytearray(as_bytes(make_cache(shape=shape, seed=4)).numpy().tobytes())
    sent = bytes(payload)
    payload[0 if where == "first" else len(payload) - 1] ^= 0xFF
    got_done: list[bytes] = []

    def behave(request: Request) -> None:
        _ok_reply(request, sent)
        request.conn.sendall(bytes(payload))
        request.conn.settimeout(2)
        got_done.append(request.conn.recv(1))

    port, thread = fake_server(behave)
    ids = list(range(num_blocks))
    result = read_blocks(lease_at(port, ENGINE, "r"), ids, torch.zeros(shape), ids, deadline())
    thread.join(3)
    assert not result.ok and result.error is not None
    assert result.error.startswith("CHECKSUM_MISMATCH")
    assert result.num_bytes == len(payload)
    assert got_done == [b""]  # the reader closed without DONE


def test_multi_chunk_read_is_byte_exact(server: KVBlockServer) -> None:
    """A read spanning several receive chunks and runs lands byte-exact."""
    num_blocks = 3 * (RECV_CHUNK_BYTES // BB) + 5
    shape = (num_blocks, *SHAPE[1:])
    remote = make_cache(shape=shape, seed=5)
    srv = KVBlockServer(remote, ENGINE, KEYS)
    srv.start()
    try:
        remote_ids = list(range(num_blocks))
        local_ids = remote_ids[num_blocks // 2 :] + remote_ids[: num_blocks // 2]
        srv.leases.lease("r", remote_ids, time.time() + 30)
        local = torch.zeros(shape)
        result = read(srv, local, "r", remote_ids, local_ids)
        assert result.ok, result.error
        assert torch.equal(as_bytes(local[local_ids]), as_bytes(remote[remote_ids]))
    finally:
        srv.stop()
