"""TCP transport for paged KV blocks: a block server (prefill side) and a reader (decode side).

The KV cache is one contiguous CPU tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]``, so one block of all layers is one contiguous byte region and a run of consecutive block
ids is one larger region. Bytes go from the server's tensor memory to the socket (``sendall`` of a
memoryview per run) and from the socket into the reader's tensor memory (``recv_into`` per run) with
no intermediate buffer.

Wire protocol, per connection (several reads may follow each other on one connection):

    client -> server  request header (_REQUEST) + engine_id + request_id + block ids (uint32 each)
    server -> client  reply header (_REPLY): status, server block_bytes, total bytes, checksum
    server -> client  on OK only: the raw bytes of each coalesced run, in the order asked
    client -> server  one DONE byte once everything arrived and the checksum matched

A request with no block ids is a release: the reader will not read this lease (it failed, or it
needs none of the blocks); the server drops the lease, reports it claimed, and replies OK with no
payload. A lease being read is never expired under the read: ``expire`` skips it, and the read
itself is bounded by the server's I/O timeout.

The checksum (``checksum.py``, xxh3-64) is computed per block, and the header carries the
checksum of those per-block values (big-endian uint64, in the order asked). Per-block values let
the server compute them when the lease is made, on a background thread, so for any subset or
order of the leased blocks the read itself pays no checksum pass on the sending side. The reader
receives in chunks of a few blocks and checksums each chunk as soon as it is complete, while the
kernel keeps taking the next bytes into the socket buffer, so its pass overlaps the transfer.
``bench/kv_transfer.py`` prints the checksum's rate and the transport's against a raw socket.

Sockets run in blocking mode with kernel timeouts (SO_RCVTIMEO/SO_SNDTIMEO) rather than Python's
socket timeouts: a Python timeout turns every recv into poll + non-blocking recv, which halved the
loopback rate of a 16 MiB read in ``bench/kv_transfer.py``. A reader may keep its connections in a
``KVConnectionPool``; a connection then carries many reads and pays connect and the server's
thread start once.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from baton.kv_transfer.checksum import block_bytes, byte_view, combine
from baton.kv_transfer.leases import MAX_HOLD_S, LeaseTable, Status

logger = logging.getLogger(__name__)

# magic, len(engine_id), len(request_id), number of block ids, the client's block_bytes
_REQUEST = struct.Struct("!4sHHIQ")
_REQUEST_MAGIC = b"BKVQ"
# magic, status, the server's block_bytes, total payload bytes, checksum of the payload
_REPLY = struct.Struct("!4sBQQQ")
_REPLY_MAGIC = b"BKVA"
_DONE = b"\x01"
# Bounds what a malformed or hostile header can make the server allocate.
_MAX_BLOCKS_PER_READ = 1 << 22
# How often the accept loop looks at the stop flag; bounds how long stop() waits for it.
_ACCEPT_POLL_S = 0.05


@dataclass(frozen=True)
class ReadResult:
    """Outcome of one read_blocks call; failures are results, never exceptions."""

    ok: bool
    error: str | None  # "<CODE>: detail" when not ok, e.g. "UNKNOWN_ENGINE: ..."
    num_bytes: int  # payload bytes received into the local cache
    seconds: float  # wall time of the whole call


def coalesce(block_ids: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive ids as (first_id, count), in the given order."""
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            first, count = runs[-1]
            runs[-1] = (first, count + 1)
        else:
            runs.append((block_id, 1))
    return runs


def _set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Kernel send and receive timeouts on a blocking socket (see the module docstring)."""
    sock.settimeout(None)
    # A zero timeval means "never time out", so round up to at least one microsecond.
    micros = max(1, int(seconds * 1e6))
    timeval = struct.pack("@ll", micros // 1_000_000, micros % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def _is_timeout(exc: OSError) -> bool:
    """Whether exc is a kernel socket timeout (EAGAIN from SO_RCVTIMEO/SO_SNDTIMEO) or Python's."""
    return isinstance(exc, TimeoutError) or exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """n bytes; None on a clean EOF before the first byte, ConnectionError on a short one."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


class KVBlockServer:
    """Serves leased KV blocks of one engine's cache to remote readers (the prefill side).

    Engine-facing methods (lease, release, expire, done_requests) are thread-safe and never block on
    I/O, so the engine's busy loop may call them every step. A lease must cover blocks the engine
    will not write or free until the lease is released, expired, or reported done.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        engine_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        io_timeout: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._view = byte_view(kv_cache)
        self._num_blocks = kv_cache.shape[0]
        self._block_bytes = block_bytes(kv_cache)
        self.engine_id = engine_id
        self._host = host
        self._port = port
        # A reader that stalls mid-transfer must not pin a server thread forever.
        self._io_timeout = io_timeout
        self._leases = LeaseTable(kv_cache, clock)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: dict[socket.socket, threading.Thread] = {}

    # ------------------------------------------------------------------ engine side

    def lease(self, request_id: str, block_ids: list[int], expires_at: float) -> None:
        """Makes block_ids readable under request_id until expires_at (Unix time)."""
        self._leases.lease(request_id, block_ids, expires_at)

    def release(self, request_id: str) -> bool:
        """Drops a lease; False when there was none."""
        return self._leases.release(request_id)

    def expire(self, now: float) -> list[str]:
        """Drops the leases whose time passed (expires_at < now) and returns their request ids."""
        return self._leases.expire(now)

    def done_requests(self) -> list[str]:
        """Request ids whose reader finished since the last call; their blocks may be freed."""
        return self._leases.claimed()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> int:
        """Binds, starts accepting in a daemon thread, and returns the bound port."""
        listener = socket.create_server((self._host, self._port))
        listener.settimeout(_ACCEPT_POLL_S)
        self._listener = listener
        self._port = listener.getsockname()[1]
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"kv-server-{self._port}", daemon=True
        )
        self._accept_thread.start()
        return self._port

    @property
    def port(self) -> int:
        return self._port

    def stop(self) -> None:
        """Closes the listener and all connections, joins all threads, well within a second."""
        self._stopping.set()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=1.0)
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            # shutdown wakes a thread blocked in recv/send on this socket; close alone may not.
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for _, thread in conns:
            thread.join(timeout=0.5)
        self._leases.stop()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        with self._listener:
            while not self._stopping.is_set():
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    break
                _set_io_timeout(conn, self._io_timeout)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
                with self._lock:
                    self._conns[conn] = thread
                thread.start()

    # ------------------------------------------------------------------ per connection

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                while not self._stopping.is_set() and self._serve_one(conn):
                    pass
        except (OSError, ConnectionError) as exc:
            logger.debug("kv connection ended: %s", exc)
        finally:
            with self._lock:
                self._conns.pop(conn, None)

    def _serve_one(self, conn: socket.socket) -> bool:
        """Serves one read; False when the connection should close."""
        head = _recv_exact(conn, _REQUEST.size)
        if head is None:
            return False
        magic, engine_len, request_len, num_blocks, client_block_bytes = _REQUEST.unpack(head)
        if magic != _REQUEST_MAGIC or num_blocks > _MAX_BLOCKS_PER_READ:
            self._reply(conn, Status.BAD_REQUEST)
            return False
        body = _recv_exact(conn, engine_len + request_len + 4 * num_blocks)
        if body is None:
            return False
        engine_id = body[:engine_len].decode("utf-8", "replace")
        request_id = body[engine_len : engine_len + request_len].decode("utf-8", "replace")
        ids = list(struct.unpack_from(f"!{num_blocks}I", body, engine_len + request_len))
        if not ids:
            self._reply(conn, self._release_for_reader(engine_id, request_id))
            return True

        status, sums = self._check(engine_id, request_id, ids, client_block_bytes)
        if status != Status.OK:
            self._reply(conn, status)
            return True
        try:
            return self._send(conn, request_id, ids, sums)
        finally:
            self._leases.end_read(request_id)

    def _release_for_reader(self, engine_id: str, request_id: str) -> Status:
        if engine_id != self.engine_id:
            return Status.UNKNOWN_ENGINE
        return Status.OK if self._leases.claim(request_id) else Status.UNKNOWN_REQUEST

    def _send(self, conn: socket.socket, request_id: str, ids: list[int], sums: list[int]) -> bool:
        bpb = self._block_bytes
        conn.sendall(_REPLY.pack(_REPLY_MAGIC, Status.OK, bpb, len(ids) * bpb, combine(sums)))
        for first, count in coalesce(ids):
            conn.sendall(self._view[first * bpb : (first + count) * bpb])
        done = _recv_exact(conn, 1)
        if done != _DONE:
            return False
        self._leases.claim(request_id)
        return True

    def _check(
        self, engine_id: str, request_id: str, ids: list[int], client_bb: int
    ) -> tuple[Status, list[int]]:
        """(OK, the checksum of each asked block) when the read may proceed, the lease then held
        against expiry until the read ends; else (the refusal, [])."""
        if engine_id != self.engine_id:
            return Status.UNKNOWN_ENGINE, []
        if client_bb != self._block_bytes:
            return Status.BLOCK_SIZE_MISMATCH, []
        # The hold's own bound is a backstop: the read ends (end_read) well before, bounded by
        # the server's I/O timeout on every send and receive.
        return self._leases.lookup(request_id, ids, MAX_HOLD_S)

    def _reply(self, conn: socket.socket, status: Status) -> None:
        conn.sendall(_REPLY.pack(_REPLY_MAGIC, status, self._block_bytes, 0, 0))
