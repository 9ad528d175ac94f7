"""The TCP transport's reader (the decode side): pulls leased blocks from a `KVBlockServer`
straight into the local KV tensor, over pooled connections, and releases leases it will not read.

The reader receives in chunks of a few blocks and checksums each chunk as soon as it is complete,
while the kernel keeps taking the next bytes into the socket buffer, so its checksum pass overlaps
the transfer. With a `StagingPool` (a cache outside host memory, or staging forced) it receives
each chunk into a host buffer instead, checksums it there and copies it into the cache while the
next chunk arrives (``staging.py``).
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass

import torch

from baton.kv_transfer.base import TransferResult
from baton.kv_transfer.checksum import block_bytes, block_checksum, byte_view, combine
from baton.kv_transfer.keyring import TAG_BYTES, KeyRing
from baton.kv_transfer.leases import Status, status_name
from baton.kv_transfer.sockets import ExchangeError, KVConnectionPool, arm, is_timeout, recv_exact
from baton.kv_transfer.tcp.staging import StagingPool
from baton.kv_transfer.tcp.wire import DONE, REPLY, REPLY_MAGIC, coalesce, pack_request

logger = logging.getLogger(__name__)

# Reader receive chunk: small enough that its checksum reads bytes the receive just left in the
# core's cache, large enough that the per-chunk Python is noise. 128 KiB measured best of 64, 128,
# 256 and 512 KiB (a 4 MiB read 0.95 ms against 1.15 ms at 512 KiB, 2 cores, payloads aligned).
RECV_CHUNK_BYTES = 128 << 10
# A larger receive buffer lets the sender run further ahead while the reader checksums a chunk;
# it cut a 1 MiB read from about 0.63 to 0.55 ms. The kernel caps it at net.core.rmem_max.
_READER_RCVBUF = 4 << 20


@dataclass(frozen=True)
class Lease:
    """A remote lease as a reader addresses it, and the key it proves itself with."""

    host: str
    port: int
    engine_id: str
    request_id: str
    keys: KeyRing
    key_id: str  # the key that signed the lease's params


def read_blocks(
    lease: Lease,
    remote_block_ids: list[int],
    kv_cache: torch.Tensor,
    local_block_ids: list[int],
    deadline: float,
    *,
    pool: KVConnectionPool | None = None,
    req_id: str | None = None,
    staging: StagingPool | None = None,
) -> TransferResult:
    """Pulls remote blocks of ``lease`` into ``kv_cache[local_block_ids]`` (the decode side).

    ``deadline`` is a ``time.monotonic()`` value; no step blocks past it. On failure the local
    blocks' contents are unspecified (bytes land in place as they arrive) and the caller recomputes.
    Sends DONE only after the size and checksum matched, so the server frees its blocks only then.
    With a ``pool`` the read reuses an idle connection to (host, port) and gives it back after
    (`KVConnectionPool.exchange`); its retry after a stale one is safe because nothing sent before
    DONE changes the server's state. The result is reported under ``req_id``, the local request's
    id (the remote ``request_id`` when not given). With ``staging`` (a pool over ``kv_cache``)
    the bytes pass through its host buffers; a cache outside host memory is always staged.
    """
    start = time.monotonic()
    result_id = lease.request_id if req_id is None else req_id

    def result(error: str | None, num_bytes: int = 0) -> TransferResult:
        return TransferResult(result_id, error is None, error, num_bytes, time.monotonic() - start)

    if len(remote_block_ids) != len(local_block_ids) or not local_block_ids:
        return result(
            f"BAD_ARGUMENT: {len(remote_block_ids)} remote ids vs {len(local_block_ids)} local ids"
        )
    own_staging = staging is None and kv_cache.device.type != "cpu"
    try:
        if own_staging:
            staging = StagingPool(kv_cache)
        view = None if staging is not None else byte_view(kv_cache)
    except ValueError as exc:
        return result(f"BAD_ARGUMENT: {exc}")
    num_blocks = kv_cache.shape[0]
    if any(not 0 <= b < num_blocks for b in local_block_ids):
        return result(f"BAD_ARGUMENT: local block ids out of range [0, {num_blocks})")
    bpb = block_bytes(kv_cache)
    where = f"request {lease.request_id!r} at {lease.host}:{lease.port}"
    read = _Read(lease, remote_block_ids, view, staging, bpb, local_block_ids, where, deadline)
    use = pool or KVConnectionPool()  # without a pool, the connection is closed after the read
    error = use.exchange(lease.host, lease.port, deadline, read.run, rcvbuf=_READER_RCVBUF)
    if pool is None:
        use.close()
    if own_staging and staging is not None:
        staging.close()
    return result(error, read.received)


def _request(
    sock: socket.socket,
    nonce: bytes,
    lease: Lease,
    block_ids: list[int],
    block_bytes: int,
    deadline: float,
) -> tuple[int, int, int, int]:
    """Sends a request for ``block_ids`` of ``lease`` (a release when there are none), tagged
    for this connection; the reply header's (status, server block_bytes, total bytes,
    checksum). An OK whose tag does not prove the key is an `ExchangeError`."""
    head, body = pack_request(
        lease.key_id, lease.engine_id, lease.request_id, block_ids, block_bytes
    )
    tag = lease.keys.tag(lease.key_id, nonce, head, body)
    if tag is None:
        raise ExchangeError(f"UNAUTHORIZED: this engine does not hold key {lease.key_id!r}")
    arm(sock, deadline)
    sock.sendall(head + body + tag)
    reply = recv_exact(sock, REPLY.size + TAG_BYTES, deadline)
    if reply is None:
        raise ConnectionError("connection closed before the reply")
    reply_head, reply_tag = reply[: REPLY.size], reply[REPLY.size :]
    magic, status, server_bb, total, checksum = REPLY.unpack(reply_head)
    if magic != REPLY_MAGIC:
        raise ExchangeError("PROTOCOL: bad reply magic")
    # Only an OK needs proof: a refusal, forged or not, ends in a recompute.
    if status == Status.OK and not lease.keys.check(
        lease.key_id, reply_tag, nonce, tag, reply_head
    ):
        raise ExchangeError(
            f"UNAUTHENTICATED: {lease.host}:{lease.port} did not prove the hand-off key"
        )
    return status, server_bb, total, checksum


@dataclass
class _Read:
    """One read's exchange; ``run`` raises `ExchangeError` when it fails."""

    lease: Lease
    remote_ids: list[int]
    view: memoryview | None  # the local KV cache's bytes; None when staged
    staging: StagingPool | None
    bpb: int
    local_ids: list[int]
    where: str  # the remote request, for errors
    deadline: float
    received: int = 0  # payload bytes received

    def run(self, sock: socket.socket, nonce: bytes) -> None:
        self.received = 0  # a retry on a new connection starts over
        expected = len(self.local_ids) * self.bpb
        got_reply = False
        try:
            status, server_bb, total, checksum = _request(
                sock, nonce, self.lease, self.remote_ids, self.bpb, self.deadline
            )
            got_reply = True
            if status != Status.OK:
                detail = f" (server {server_bb}, local {self.bpb})" if server_bb != self.bpb else ""
                raise ExchangeError(f"{status_name(status)}: {self.where}{detail}")
            if server_bb != self.bpb or total != expected:
                raise ExchangeError(
                    f"BLOCK_SIZE_MISMATCH: server block {server_bb} B, local {self.bpb} B; "
                    f"server sends {total} B, expected {expected} B"
                )
            actual = combine(self._recv_payload(sock, expected))
            if actual != checksum:
                raise ExchangeError(
                    f"CHECKSUM_MISMATCH: got {actual:#018x}, server said {checksum:#018x}"
                )
            # Not re-armed: the send timeout set for the request still bounds it, and one byte
            # into a send buffer the server has emptied (it answered the request) never blocks.
            sock.sendall(DONE)
        except OSError as exc:
            if is_timeout(exc):
                raise ExchangeError(f"DEADLINE: after {self.received} of {expected} B") from None
            code = "SHORT_READ" if isinstance(exc, ConnectionError) else "IO_ERROR"
            raise ExchangeError(f"{code}: {exc}", stale=not got_reply) from None

    def _recv_payload(self, sock: socket.socket, expected: int) -> list[int]:
        """Receives every block and returns their checksums, chunk by chunk (see the module
        docstring)."""

        def recv_into(chunk: memoryview) -> None:
            got = 0
            while got < len(chunk):
                arm(sock, self.deadline, send=False)
                k = sock.recv_into(chunk[got:], 0, socket.MSG_WAITALL)
                if k == 0:
                    raise ExchangeError(
                        f"SHORT_READ: connection closed after {self.received} of {expected} B"
                    )
                got += k
                self.received += k

        if self.staging is not None:
            with self.staging.stager() as stager:
                return stager.receive(self.local_ids, recv_into)
        bpb, view = self.bpb, self.view
        assert view is not None
        per_chunk = max(1, RECV_CHUNK_BYTES // bpb)
        crcs: list[int] = []
        for first, count in coalesce(self.local_ids):
            for offset in range(0, count, per_chunk):
                lo = first + offset
                hi = lo + min(per_chunk, count - offset)
                recv_into(view[lo * bpb : hi * bpb])
                crcs.extend(block_checksum(view[b * bpb : (b + 1) * bpb]) for b in range(lo, hi))
        return crcs


def release_lease(lease: Lease, deadline: float, *, pool: KVConnectionPool) -> str | None:
    """Tells a block server that ``lease`` will not be read, so it frees the blocks now rather
    than at expiry. Returns None on success, else the error; never raises."""

    def run(sock: socket.socket, nonce: bytes) -> int:
        try:
            return _request(sock, nonce, lease, [], 0, deadline)[0]
        except OSError as exc:
            code = "SHORT_READ" if isinstance(exc, ConnectionError) else "IO_ERROR"
            raise ExchangeError(f"{'DEADLINE' if is_timeout(exc) else code}: {exc}") from None

    # The same options as a read's connection: the pool may hand it to a read next.
    status = pool.exchange(lease.host, lease.port, deadline, run, rcvbuf=_READER_RCVBUF)
    if isinstance(status, str):
        return status
    if status == Status.OK:
        return None
    return f"{status_name(status)}: release of {lease.request_id!r}"
