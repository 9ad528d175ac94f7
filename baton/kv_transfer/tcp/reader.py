"""The TCP transport's reader (the decode side): pulls leased blocks from a `KVBlockServer`
straight into the local KV tensor, over pooled connections, and releases leases it will not read.

The reader receives in chunks of a few blocks and checksums each chunk as soon as it is complete,
while the kernel keeps taking the next bytes into the socket buffer, so its checksum pass overlaps
the transfer.
"""

from __future__ import annotations

import logging
import socket
import time

import torch

from baton.kv_transfer.base import TransferResult
from baton.kv_transfer.checksum import block_bytes, block_checksum, byte_view, combine
from baton.kv_transfer.leases import Status, status_name
from baton.kv_transfer.sockets import (
    KVConnectionPool,
    arm,
    connect,
    is_timeout,
    recv_exact,
)
from baton.kv_transfer.tcp.wire import DONE, REPLY, REPLY_MAGIC, coalesce, pack_request

logger = logging.getLogger(__name__)

# Reader receive chunk: small enough to stay in cache for its checksum, large enough that the
# per-chunk Python work is noise. 512 KiB measured best of 256 KiB, 512 KiB and 1 MiB.
RECV_CHUNK_BYTES = 512 << 10
# A larger receive buffer lets the sender run further ahead while the reader checksums a chunk;
# it cut a 1 MiB read from about 0.63 to 0.55 ms. The kernel caps it at net.core.rmem_max.
_READER_RCVBUF = 4 << 20


def read_blocks(
    host: str,
    port: int,
    engine_id: str,
    request_id: str,
    remote_block_ids: list[int],
    kv_cache: torch.Tensor,
    local_block_ids: list[int],
    deadline: float,
    *,
    pool: KVConnectionPool | None = None,
    req_id: str | None = None,
) -> TransferResult:
    """Pulls remote blocks into ``kv_cache[local_block_ids]`` (the decode side).

    ``deadline`` is a ``time.monotonic()`` value; no step blocks past it. On failure the local
    blocks' contents are unspecified (bytes land in place as they arrive) and the caller recomputes.
    Sends DONE only after the size and checksum matched, so the server frees its blocks only then.
    With a ``pool`` the read reuses an idle connection to (host, port) and returns it afterwards;
    when a reused connection turns out dead before any reply byte (the server closed it while it
    sat idle), the read retries once on a new connection, which is safe because nothing was sent
    before DONE can change the server's state. The result is reported under ``req_id``, the local
    request's id (the remote ``request_id`` when not given).
    """
    start = time.monotonic()
    result_id = request_id if req_id is None else req_id

    def result(error: str | None, num_bytes: int = 0) -> TransferResult:
        return TransferResult(result_id, error is None, error, num_bytes, time.monotonic() - start)

    if len(remote_block_ids) != len(local_block_ids) or not local_block_ids:
        return result(
            f"BAD_ARGUMENT: {len(remote_block_ids)} remote ids vs {len(local_block_ids)} local ids"
        )
    try:
        view = byte_view(kv_cache)
    except ValueError as exc:
        return result(f"BAD_ARGUMENT: {exc}")
    num_blocks = kv_cache.shape[0]
    if any(not 0 <= b < num_blocks for b in local_block_ids):
        return result(f"BAD_ARGUMENT: local block ids out of range [0, {num_blocks})")
    if any(not 0 <= b < 2**32 for b in remote_block_ids):
        return result("BAD_ARGUMENT: remote block ids must fit in uint32")
    bpb = block_bytes(kv_cache)
    request = pack_request(engine_id, request_id, remote_block_ids, bpb)
    read = _Read(view, bpb, local_block_ids, request_id, host, port, deadline)

    sock = pool.take(host, port) if pool is not None else None
    if pool is not None and sock is not None:
        error = read.run(sock, request)
        if error is None:
            pool.give(host, port, sock)
            return result(None, read.received)
        sock.close()
        if not read.stale:
            return result(error, read.received)
        logger.debug("kv pooled connection to %s:%s was dead, reconnecting", host, port)
        read = _Read(view, bpb, local_block_ids, request_id, host, port, deadline)

    new = connect(host, port, deadline, rcvbuf=_READER_RCVBUF)
    if isinstance(new, str):
        return result(new)
    if pool is not None:
        pool.connects += 1
    error = read.run(new, request)
    if error is not None:
        new.close()
        return result(error, read.received)
    if pool is not None:
        pool.give(host, port, new)
    else:
        new.close()
    return result(None, read.received)


class _Read:
    """One read's exchange on one connection; run() returns None on success, else the error."""

    def __init__(
        self,
        view: memoryview,
        bpb: int,
        local_block_ids: list[int],
        request_id: str,
        host: str,
        port: int,
        deadline: float,
    ) -> None:
        self._view = view
        self._bpb = bpb
        self._local_ids = local_block_ids
        self._request_id = request_id
        self._peer = f"{host}:{port}"
        self._deadline = deadline
        self.received = 0  # payload bytes received
        self.stale = False  # the connection was dead before any reply byte; a retry is safe

    def run(self, sock: socket.socket, request: bytes) -> str | None:
        expected = len(self._local_ids) * self._bpb
        got_reply = False
        try:
            arm(sock, self._deadline)
            sock.sendall(request)
            head = self._recv_head(sock)
            got_reply = True
            magic, status, server_bb, total, checksum = REPLY.unpack(head)
            if magic != REPLY_MAGIC:
                return "PROTOCOL: bad reply magic"
            if status != Status.OK:
                bpb = self._bpb
                detail = f" (server {server_bb}, local {bpb})" if server_bb != bpb else ""
                where = f"request {self._request_id!r} at {self._peer}"
                return f"{status_name(status)}: {where}{detail}"
            if server_bb != self._bpb or total != expected:
                return (
                    f"BLOCK_SIZE_MISMATCH: server block {server_bb} B, local {self._bpb} B; "
                    f"server sends {total} B, expected {expected} B"
                )
            crcs = self._recv_payload(sock)
            if crcs is None:
                return f"SHORT_READ: connection closed after {self.received} of {expected} B"
            actual = combine(crcs)
            if actual != checksum:
                return f"CHECKSUM_MISMATCH: got {actual:#018x}, server said {checksum:#018x}"
            arm(sock, self._deadline)
            sock.sendall(DONE)
        except OSError as exc:
            if is_timeout(exc):
                return f"DEADLINE: after {self.received} of {expected} B"
            self.stale = not got_reply
            if isinstance(exc, ConnectionError):
                return f"SHORT_READ: {exc}"
            return f"IO_ERROR: {exc}"
        return None

    def _recv_head(self, sock: socket.socket) -> bytes:
        """The reply header; ConnectionError when the connection closes first."""
        buf = bytearray(REPLY.size)
        view = memoryview(buf)
        got = 0
        while got < len(buf):
            # Re-armed per receive: a kernel timeout bounds one call, the deadline the whole read.
            arm(sock, self._deadline)
            k = sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError(f"connection closed after {got} of {len(buf)} header bytes")
            got += k
        return bytes(buf)

    def _recv_payload(self, sock: socket.socket) -> list[int] | None:
        """Receives every block in place and returns their checksums; None on an early EOF.

        Each chunk of a few blocks is checksummed as soon as it is complete: by then the kernel
        is already taking the next chunk's bytes into the socket buffer, so the checksum pass
        overlaps the transfer.
        """
        bpb, view = self._bpb, self._view
        per_chunk = max(1, RECV_CHUNK_BYTES // bpb)
        crcs: list[int] = []
        for first, count in coalesce(self._local_ids):
            for offset in range(0, count, per_chunk):
                lo = first + offset
                hi = lo + min(per_chunk, count - offset)
                chunk = view[lo * bpb : hi * bpb]
                got = 0
                while got < len(chunk):
                    arm(sock, self._deadline)
                    k = sock.recv_into(chunk[got:], 0, socket.MSG_WAITALL)
                    if k == 0:
                        return None
                    got += k
                    self.received += k
                crcs.extend(block_checksum(view[b * bpb : (b + 1) * bpb]) for b in range(lo, hi))
        return crcs


def release_lease(
    host: str,
    port: int,
    engine_id: str,
    request_id: str,
    deadline: float,
    *,
    pool: KVConnectionPool | None = None,
) -> str | None:
    """Tells a block server that its lease under request_id will not be read, so it frees the
    blocks now rather than at expiry. Returns None on success, else the error; never raises."""
    sock = pool.take(host, port) if pool is not None else None
    if sock is None:
        # The same options as a read's connection: the pool may hand it to a read next.
        new = connect(host, port, deadline, rcvbuf=_READER_RCVBUF)
        if isinstance(new, str):
            return new
        if pool is not None:
            pool.connects += 1
        sock = new
    try:
        arm(sock, deadline)
        sock.sendall(pack_request(engine_id, request_id, [], 0))
        head = recv_exact(sock, REPLY.size)
    except OSError as exc:
        sock.close()
        return f"{'DEADLINE' if is_timeout(exc) else 'IO_ERROR'}: {exc}"
    if head is None:
        sock.close()
        return "SHORT_READ: connection closed before the reply"
    magic, status, _, _, _ = REPLY.unpack(head)
    if magic != REPLY_MAGIC:
        sock.close()
        return "PROTOCOL: bad reply magic"
    if pool is not None:
        pool.give(host, port, sock)
    else:
        sock.close()
    return None if status == Status.OK else f"{status_name(status)}: release of {request_id!r}"
