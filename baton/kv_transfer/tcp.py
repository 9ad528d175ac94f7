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
import enum
import errno
import logging
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from baton.kv_transfer.checksum import block_checksum, combine

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
# Remember this many expired request ids so a late reader hears EXPIRED, not UNKNOWN_REQUEST.
_EXPIRED_MEMORY = 4096
# How often the accept loop looks at the stop flag; bounds how long stop() waits for it.
_ACCEPT_POLL_S = 0.05


class Status(enum.IntEnum):
    """Reply status of the block server; a reader reports the name of a non-OK status."""

    OK = 0
    UNKNOWN_ENGINE = 1  # engine_id differs: the engine at this address restarted, its memory is new
    UNKNOWN_REQUEST = 2  # no lease under this request id (never leased, released, or already done)
    EXPIRED = 3  # the lease passed its expiry time
    BAD_BLOCKS = 4  # asked ids are not among the leased ones, or out of range
    BLOCK_SIZE_MISMATCH = 5  # the two caches' blocks have different byte sizes
    BAD_REQUEST = 6  # malformed header


@dataclass(frozen=True)
class ReadResult:
    """Outcome of one read_blocks call; failures are results, never exceptions."""

    ok: bool
    error: str | None  # "<CODE>: detail" when not ok, e.g. "UNKNOWN_ENGINE: ..."
    num_bytes: int  # payload bytes received into the local cache
    seconds: float  # wall time of the whole call


@dataclass(frozen=True)
class _Lease:
    block_ids: frozenset[int]
    expires_at: float  # Unix time, seconds
    crcs: Future[dict[int, int]]  # block id -> checksum of its bytes, computed off the busy loop


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


def block_bytes(kv_cache: torch.Tensor) -> int:
    """Bytes of one block of all layers: ``kv_cache[0]``."""
    return kv_cache[0].numel() * kv_cache.element_size()


def _byte_view(kv_cache: torch.Tensor) -> memoryview:
    """A writable memoryview over the tensor's own storage (no copy)."""
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous() or kv_cache.dim() < 1:
        raise ValueError(
            "kv_cache must be a contiguous CPU tensor [num_blocks, ...], got "
            f"device={kv_cache.device} contiguous={kv_cache.is_contiguous()} "
            f"shape={tuple(kv_cache.shape)}"
        )
    # view(uint8) reinterprets the bytes of any dtype (bf16 included, which numpy lacks).
    return kv_cache.detach().reshape(-1).view(torch.uint8).numpy().data


def _block_sum(view: memoryview, block_id: int, bytes_per_block: int) -> int:
    return block_checksum(view[block_id * bytes_per_block : (block_id + 1) * bytes_per_block])


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
        self._view = _byte_view(kv_cache)
        self._num_blocks = kv_cache.shape[0]
        self._block_bytes = block_bytes(kv_cache)
        self.engine_id = engine_id
        self._host = host
        self._port = port
        # A reader that stalls mid-transfer must not pin a server thread forever.
        self._io_timeout = io_timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._done: list[str] = []
        self._reading: dict[str, int] = {}  # request id -> reads in progress
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: dict[socket.socket, threading.Thread] = {}
        # One worker: checksumming is background work and must not crowd out the engine.
        self._crc_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-crc")

    # ------------------------------------------------------------------ engine side

    def lease(self, request_id: str, block_ids: list[int], expires_at: float) -> None:
        """Makes block_ids readable under request_id until expires_at (Unix time)."""
        bad = [b for b in block_ids if not 0 <= b < self._num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:8]} out of range [0, {self._num_blocks})")
        ids = sorted(set(block_ids))
        crcs = self._crc_pool.submit(
            lambda: {b: _block_sum(self._view, b, self._block_bytes) for b in ids}
        )
        with self._lock:
            self._leases[request_id] = _Lease(frozenset(ids), expires_at, crcs)
            self._expired.pop(request_id, None)

    def release(self, request_id: str) -> bool:
        """Drops a lease; False when there was none."""
        with self._lock:
            return self._leases.pop(request_id, None) is not None

    def expire(self, now: float) -> list[str]:
        """Drops the leases whose time passed (expires_at < now) and returns their request ids."""
        with self._lock:
            gone = [
                rid
                for rid, lease in self._leases.items()
                if lease.expires_at < now and rid not in self._reading
            ]
            for rid in gone:
                del self._leases[rid]
                self._expired[rid] = None
            while len(self._expired) > _EXPIRED_MEMORY:
                self._expired.popitem(last=False)
        return gone

    def done_requests(self) -> list[str]:
        """Request ids whose reader finished since the last call; their blocks may be freed."""
        with self._lock:
            done, self._done = self._done, []
        return done

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
        # Waits for at most the one lease's checksum pass in progress.
        self._crc_pool.shutdown(wait=True, cancel_futures=True)

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

        status, lease = self._check(engine_id, request_id, ids, client_block_bytes)
        if lease is None:
            self._reply(conn, status)
            return True
        try:
            return self._send(conn, request_id, ids, lease)
        finally:
            with self._lock:
                left = self._reading.pop(request_id) - 1
                if left:
                    self._reading[request_id] = left

    def _release_for_reader(self, engine_id: str, request_id: str) -> Status:
        if engine_id != self.engine_id:
            return Status.UNKNOWN_ENGINE
        with self._lock:
            if self._leases.pop(request_id, None) is None:
                return Status.UNKNOWN_REQUEST
            self._done.append(request_id)
        return Status.OK

    def _send(self, conn: socket.socket, request_id: str, ids: list[int], lease: _Lease) -> bool:
        bpb = self._block_bytes
        # Not waiting on an unfinished background pass: it may be queued behind other leases.
        fut = lease.crcs
        table = fut.result() if fut.done() and not fut.cancelled() else None
        sums = [table[b] if table is not None else _block_sum(self._view, b, bpb) for b in ids]
        conn.sendall(_REPLY.pack(_REPLY_MAGIC, Status.OK, bpb, len(ids) * bpb, combine(sums)))
        runs = coalesce(ids)
        for first, count in runs:
            conn.sendall(self._view[first * bpb : (first + count) * bpb])
        done = _recv_exact(conn, 1)
        if done != _DONE:
            return False
        with self._lock:
            if self._leases.pop(request_id, None) is not None:
                self._done.append(request_id)
        return True

    def _check(
        self, engine_id: str, request_id: str, ids: list[int], client_bb: int
    ) -> tuple[Status, _Lease | None]:
        """(OK, the lease) when the read may proceed, else (the refusal, None)."""
        if engine_id != self.engine_id:
            return Status.UNKNOWN_ENGINE, None
        if client_bb != self._block_bytes:
            return Status.BLOCK_SIZE_MISMATCH, None
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                expired = request_id in self._expired
                return (Status.EXPIRED if expired else Status.UNKNOWN_REQUEST), None
            # Checked here too, not only in expire(): the engine sweeps once per step at best.
            if lease.expires_at < self._clock():
                return Status.EXPIRED, None
            # A subset is fine: the reader may already hold a prefix of the prompt's blocks.
            if not lease.block_ids.issuperset(ids):
                return Status.BAD_BLOCKS, None
            # From here until the read ends, expire() leaves this lease alone.
            self._reading[request_id] = self._reading.get(request_id, 0) + 1
        return Status.OK, lease

    def _reply(self, conn: socket.socket, status: Status) -> None:
        conn.sendall(_REPLY.pack(_REPLY_MAGIC, status, self._block_bytes, 0, 0))
