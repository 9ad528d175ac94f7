"""The reading (decode) side of the TCP KV transport: pulls leased blocks from a
`KVBlockServer` straight into the local KV tensor, over pooled connections.

The wire protocol and the block server are in `tcp.py`.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable

import torch

from baton.kv_transfer.checksum import block_bytes, block_checksum, byte_view, combine
from baton.kv_transfer.leases import Status
from baton.kv_transfer.tcp import (
    _DONE,
    _REPLY,
    _REPLY_MAGIC,
    _REQUEST,
    _REQUEST_MAGIC,
    ReadResult,
    _is_timeout,
    _set_io_timeout,
    coalesce,
)

logger = logging.getLogger(__name__)

# Reader receive chunk: small enough to stay in cache for its checksum, large enough that the
# per-chunk Python work is noise. 512 KiB measured best of 256 KiB, 512 KiB and 1 MiB.
_CHUNK_BYTES = 512 << 10
# A larger receive buffer lets the sender run further ahead while the reader checksums a chunk;
# it cut a 1 MiB read from about 0.63 to 0.55 ms. The kernel caps it at net.core.rmem_max.
_READER_RCVBUF = 4 << 20
# A pooled connection idle longer than this is closed rather than reused; kept well under the
# server's default io_timeout (30 s), after which the server closes an idle connection.
_POOL_MAX_IDLE_S = 10.0


class KVConnectionPool:
    """Idle reader connections per (host, port), so that many reads share one connection.

    Thread-safe; each connection serves one read at a time (a read takes it out of the pool and
    puts it back only after a successful read). A connection that saw any error or refusal is
    closed, never reused. Reads pass the pool to ``read_blocks``; ``close`` closes the idle ones.
    """

    def __init__(
        self,
        max_idle_per_peer: int = 4,
        max_idle_s: float = _POOL_MAX_IDLE_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_idle_per_peer < 1 or max_idle_s <= 0:
            raise ValueError(
                f"max_idle_per_peer must be >= 1 and max_idle_s > 0, got {max_idle_per_peer}, "
                f"{max_idle_s}"
            )
        self._max_idle_per_peer = max_idle_per_peer
        self._max_idle_s = max_idle_s
        self._clock = clock
        self._lock = threading.Lock()
        # (host, port) -> idle connections with the time each was put back, most recent last
        self._idle: dict[tuple[str, int], list[tuple[socket.socket, float]]] = {}
        self.connects = 0  # connections opened through this pool, for tests and benchmarks

    def take(self, host: str, port: int) -> socket.socket | None:
        """An idle connection to (host, port) that still looks healthy, or None."""
        now = self._clock()
        while True:
            with self._lock:
                idle = self._idle.get((host, port))
                if not idle:
                    return None
                sock, since = idle.pop()
            if now - since <= self._max_idle_s and _looks_idle(sock):
                return sock
            sock.close()

    def give(self, host: str, port: int, sock: socket.socket) -> None:
        """Returns a connection after a successful read; closes it when the pool is full."""
        with self._lock:
            idle = self._idle.setdefault((host, port), [])
            if len(idle) < self._max_idle_per_peer:
                idle.append((sock, self._clock()))
                return
        sock.close()

    def close(self) -> None:
        """Closes every idle connection; the pool stays usable."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for sock, _ in conns:
                sock.close()

    def __enter__(self) -> KVConnectionPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _looks_idle(sock: socket.socket) -> bool:
    """True when nothing is readable: no EOF, reset or stray bytes arrived while it sat idle."""
    try:
        return not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # b"" is EOF
    except BlockingIOError:
        return True
    except OSError:
        return False


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
) -> ReadResult:
    """Pulls remote blocks into ``kv_cache[local_block_ids]`` (the decode side).

    ``deadline`` is a ``time.monotonic()`` value; no step blocks past it. On failure the local
    blocks' contents are unspecified (bytes land in place as they arrive) and the caller recomputes.
    Sends DONE only after the size and checksum matched, so the server frees its blocks only then.
    With a ``pool`` the read reuses an idle connection to (host, port) and returns it afterwards;
    when a reused connection turns out dead before any reply byte (the server closed it while it
    sat idle), the read retries once on a new connection, which is safe because nothing was sent
    before DONE can change the server's state.
    """
    start = time.monotonic()

    def fail(error: str, num_bytes: int = 0) -> ReadResult:
        return ReadResult(False, error, num_bytes, time.monotonic() - start)

    if len(remote_block_ids) != len(local_block_ids) or not local_block_ids:
        return fail(
            f"BAD_ARGUMENT: {len(remote_block_ids)} remote ids vs {len(local_block_ids)} local ids"
        )
    try:
        view = byte_view(kv_cache)
    except ValueError as exc:
        return fail(f"BAD_ARGUMENT: {exc}")
    num_blocks = kv_cache.shape[0]
    if any(not 0 <= b < num_blocks for b in local_block_ids):
        return fail(f"BAD_ARGUMENT: local block ids out of range [0, {num_blocks})")
    if any(not 0 <= b < 2**32 for b in remote_block_ids):
        return fail("BAD_ARGUMENT: remote block ids must fit in uint32")
    bpb = block_bytes(kv_cache)
    engine_b, request_b = engine_id.encode(), request_id.encode()
    request = (
        _REQUEST.pack(_REQUEST_MAGIC, len(engine_b), len(request_b), len(local_block_ids), bpb)
        + engine_b
        + request_b
        + struct.pack(f"!{len(remote_block_ids)}I", *remote_block_ids)
    )
    read = _Read(view, bpb, local_block_ids, request_id, host, port, deadline)

    sock = pool.take(host, port) if pool is not None else None
    if pool is not None and sock is not None:
        error = read.run(sock, request)
        if error is None:
            pool.give(host, port, sock)
            return ReadResult(True, None, read.received, time.monotonic() - start)
        sock.close()
        if not read.stale:
            return fail(error, read.received)
        logger.debug("kv pooled connection to %s:%s was dead, reconnecting", host, port)
        read = _Read(view, bpb, local_block_ids, request_id, host, port, deadline)

    try:
        left = deadline - time.monotonic()
        if left <= 0:
            return fail(f"DEADLINE: connecting to {host}:{port}")
        sock = socket.create_connection((host, port), timeout=left)
    except TimeoutError:
        return fail(f"DEADLINE: connecting to {host}:{port}")
    except OSError as exc:
        return fail(f"CONNECT_FAILED: {host}:{port}: {exc}")
    if pool is not None:
        pool.connects += 1
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _READER_RCVBUF)
    except OSError as exc:
        sock.close()
        return fail(f"IO_ERROR: {exc}")
    error = read.run(sock, request)
    if error is not None:
        sock.close()
        return fail(error, read.received)
    if pool is not None:
        pool.give(host, port, sock)
    else:
        sock.close()
    return ReadResult(True, None, read.received, time.monotonic() - start)


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

    def _arm(self, sock: socket.socket) -> None:
        """Re-arms the kernel timeouts to the time left; TimeoutError once the deadline passed."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        _set_io_timeout(sock, left)

    def run(self, sock: socket.socket, request: bytes) -> str | None:
        expected = len(self._local_ids) * self._bpb
        got_reply = False
        try:
            self._arm(sock)
            sock.sendall(request)
            head = self._recv_head(sock)
            got_reply = True
            magic, status, server_bb, total, checksum = _REPLY.unpack(head)
            if magic != _REPLY_MAGIC:
                return "PROTOCOL: bad reply magic"
            if status != Status.OK:
                try:
                    name = Status(status).name
                except ValueError:
                    name = f"STATUS_{status}"
                bpb = self._bpb
                detail = f" (server {server_bb}, local {bpb})" if server_bb != bpb else ""
                return f"{name}: request {self._request_id!r} at {self._peer}{detail}"
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
            self._arm(sock)
            sock.sendall(_DONE)
        except OSError as exc:
            if _is_timeout(exc):
                return f"DEADLINE: after {self.received} of {expected} B"
            self.stale = not got_reply
            if isinstance(exc, ConnectionError):
                return f"SHORT_READ: {exc}"
            return f"IO_ERROR: {exc}"
        return None

    def _recv_head(self, sock: socket.socket) -> bytes:
        """The reply header; ConnectionError when the connection closes first."""
        buf = bytearray(_REPLY.size)
        view = memoryview(buf)
        got = 0
        while got < len(buf):
            self._arm(sock)
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
        per_chunk = max(1, _CHUNK_BYTES // bpb)
        crcs: list[int] = []
        for first, count in coalesce(self._local_ids):
            for offset in range(0, count, per_chunk):
                lo = first + offset
                hi = lo + min(per_chunk, count - offset)
                chunk = view[lo * bpb : hi * bpb]
                got = 0
                while got < len(chunk):
                    self._arm(sock)
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
    engine_b, request_b = engine_id.encode(), request_id.encode()
    request = _REQUEST.pack(_REQUEST_MAGIC, len(engine_b), len(request_b), 0, 0) + engine_b
    request += request_b
    sock = pool.take(host, port) if pool is not None else None
    try:
        if sock is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return "DEADLINE: before connecting"
            sock = socket.create_connection((host, port), timeout=left)
        left = deadline - time.monotonic()
        if left <= 0:
            return "DEADLINE: before sending"
        _set_io_timeout(sock, left)
        sock.sendall(request)
        head = b""
        while len(head) < _REPLY.size:
            chunk = sock.recv(_REPLY.size - len(head))
            if not chunk:
                return "SHORT_READ: connection closed before the reply"
            head += chunk
    except OSError as exc:
        if sock is not None:
            sock.close()
        return f"{'DEADLINE' if _is_timeout(exc) else 'IO_ERROR'}: {exc}"
    magic, status, _, _, _ = _REPLY.unpack(head)
    if pool is not None and magic == _REPLY_MAGIC:
        pool.give(host, port, sock)
    else:
        sock.close()
    if magic != _REPLY_MAGIC:
        return "PROTOCOL: bad reply magic"
    return None if status == Status.OK else f"{Status(status).name}: release of {request_id!r}"
