"""The NIXL transport's side channel and lease table: length-prefixed msgpack messages between a
reader and a serving engine, the serving side's leases (with holds that keep a lease from expiring
under a read), block checksums, and block-region helpers. Nothing here needs the ``nixl`` package;
the transport itself is in ``nixl.py``.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import torch

from baton.kv_transfer.checksum import block_checksum
from baton.kv_transfer.tcp import Status, _byte_view, _recv_exact, block_bytes

_FRAME = struct.Struct("!I")
_MAX_FRAME = 64 << 20  # bounds what a malformed length can make either side allocate
_MAX_HOLD_S = 30.0  # longest a Lookup protects a lease from expiry (a reader that died)
_EXPIRED_MEMORY = 4096  # expired ids remembered, so a late reader hears EXPIRED


# ---- side-channel messages --------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello", frozen=True):
    engine_id: str  # the reader's expectation; the reply carries the server's own id


class Lookup(msgspec.Struct, tag="lookup", frozen=True):
    engine_id: str
    request_id: str
    block_ids: list[int]
    block_bytes: int
    hold_s: float  # the reader's time left: the lease is not expired under the read before then


class Done(msgspec.Struct, tag="done", frozen=True):
    """One way: the blocks arrived and matched; the server frees them."""

    engine_id: str
    request_id: str


class Release(msgspec.Struct, tag="release", frozen=True):
    """The reader will not read (or failed to read) this lease; the server frees it now."""

    engine_id: str
    request_id: str


class Reply(msgspec.Struct, frozen=True):
    status: int
    engine_id: str = ""
    # Hello: what the reader needs to address the server's blocks
    agent_metadata: bytes = b""
    base_addr: int = 0
    num_blocks: int = 0
    block_bytes: int = 0
    mem_type: str = "DRAM"
    device_id: int = 0
    # Lookup: the checksum of each asked block, in the order asked
    crcs: list[int] = []


Message = Hello | Lookup | Done | Release
encoder = msgspec.msgpack.Encoder()
message_decoder = msgspec.msgpack.Decoder(Message)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def send_message(sock: socket.socket, message: Message | Reply) -> None:
    payload = encoder.encode(message)
    sock.sendall(_FRAME.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket) -> bytes | None:
    """One frame's payload; None on a clean EOF before it, ConnectionError on a short one."""
    head = _recv_exact(sock, _FRAME.size)
    if head is None:
        return None
    (size,) = _FRAME.unpack(head)
    if size > _MAX_FRAME:
        raise ConnectionError(f"frame of {size} B exceeds {_MAX_FRAME} B")
    payload = _recv_exact(sock, size) if size else b""
    if payload is None:
        raise ConnectionError("connection closed before the frame's payload")
    return payload


def block_crcs(kv_cache: torch.Tensor, block_ids: list[int]) -> list[int]:
    """The checksum of each block's bytes, in the order given; device blocks are copied to host
    first."""
    if kv_cache.device.type != "cpu":
        kv_cache = kv_cache[block_ids].cpu()
        block_ids = list(range(len(block_ids)))
    view, bpb = _byte_view(kv_cache), block_bytes(kv_cache)
    return [block_checksum(view[b * bpb : (b + 1) * bpb]) for b in block_ids]


def paired_runs(remote_ids: list[int], local_ids: list[int]) -> list[tuple[int, int, int]]:
    """(remote_first, local_first, count) runs where both sides' ids are consecutive: each run is
    one NIXL descriptor of ``count`` blocks on either side."""
    runs: list[tuple[int, int, int]] = []
    for remote, local in zip(remote_ids, local_ids, strict=True):
        if runs:
            r, loc, n = runs[-1]
            if r + n == remote and loc + n == local:
                runs[-1] = (r, loc, n + 1)
                continue
        runs.append((remote, local, 1))
    return runs


def split_runs(
    runs: list[tuple[int, int, int]], max_blocks: int
) -> list[list[tuple[int, int, int]]]:
    """The runs in order, cut into chunks of at most ``max_blocks`` blocks each."""
    chunks: list[list[tuple[int, int, int]]] = [[]]
    room = max_blocks
    for remote, local, count in runs:
        while count:
            if room == 0:
                chunks.append([])
                room = max_blocks
            take = min(count, room)
            chunks[-1].append((remote, local, take))
            remote, local, count, room = remote + take, local + take, count - take, room - take
    return chunks


# ---- serving side -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Lease:
    block_ids: frozenset[int]
    expires_at: float  # Unix time, seconds
    crcs: Future[list[int]]  # per block, in sorted id order; computed off the engine's thread


class LeaseTable:
    """Leases of one engine, thread-safe; engine-facing calls never block on I/O."""

    def __init__(self, kv_cache: torch.Tensor, clock: Callable[[], float] = time.time) -> None:
        self._kv = kv_cache
        self._num_blocks = kv_cache.shape[0]
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._claimed: list[str] = []
        self._holds: dict[str, float] = {}  # request id -> monotonic time its read may last to
        self.reading = threading.Event()  # set while any hold is active
        # One worker: checksumming is background work and must not crowd out the engine.
        self._crc_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-crc")

    def lease(self, request_id: str, block_ids: list[int], expires_at: float) -> None:
        bad = [b for b in block_ids if not 0 <= b < self._num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:8]} out of range [0, {self._num_blocks})")
        ids = sorted(set(block_ids))
        crcs = self._crc_pool.submit(block_crcs, self._kv, ids)
        with self._lock:
            self._leases[request_id] = _Lease(frozenset(ids), expires_at, crcs)
            self._expired.pop(request_id, None)

    def lookup(self, request_id: str, ids: list[int], hold_s: float) -> tuple[Status, list[int]]:
        """(OK, the checksum of each asked block) and a hold on the lease, or (the refusal, [])."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                expired = request_id in self._expired
                return (Status.EXPIRED if expired else Status.UNKNOWN_REQUEST), []
            # Checked here too, not only in expire(): the engine sweeps once per step at best.
            if lease.expires_at < self._clock():
                return Status.EXPIRED, []
            # A subset is fine: the reader may already hold a prefix of the prompt's blocks.
            if not ids or not lease.block_ids.issuperset(ids):
                return Status.BAD_BLOCKS, []
            until = time.monotonic() + min(max(hold_s, 0.0), _MAX_HOLD_S)
            self._holds[request_id] = max(until, self._holds.get(request_id, 0.0))
            self.reading.set()
        # Not waiting on an unfinished background pass: it may be queued behind other leases.
        fut = lease.crcs
        if fut.done() and not fut.cancelled():
            table = dict(zip(sorted(lease.block_ids), fut.result(), strict=True))
            return Status.OK, [table[b] for b in ids]
        return Status.OK, block_crcs(self._kv, ids)

    def claim(self, request_id: str) -> bool:
        """Done or released by a reader: the lease is gone and reported claimed."""
        with self._lock:
            self._drop_hold(request_id)
            if self._leases.pop(request_id, None) is None:
                return False
            self._claimed.append(request_id)
            return True

    def expire(self, now: float) -> list[str]:
        with self._lock:
            self._drop_stale_holds()
            gone = [
                rid
                for rid, lease in self._leases.items()
                if lease.expires_at < now and rid not in self._holds
            ]
            for rid in gone:
                del self._leases[rid]
                self._expired[rid] = None
            while len(self._expired) > _EXPIRED_MEMORY:
                self._expired.popitem(last=False)
        return gone

    def claimed(self) -> list[str]:
        with self._lock:
            claimed, self._claimed = self._claimed, []
        return claimed

    def holding(self) -> bool:
        """Whether a read may still be in progress (drops holds that ran out)."""
        with self._lock:
            self._drop_stale_holds()
            return bool(self._holds)

    def _drop_stale_holds(self) -> None:
        mono = time.monotonic()
        for rid in [r for r, until in self._holds.items() if until < mono]:
            self._drop_hold(rid)

    def _drop_hold(self, request_id: str) -> None:
        self._holds.pop(request_id, None)
        if not self._holds:
            self.reading.clear()

    def stop(self) -> None:
        # Waits for at most the one lease's checksum pass in progress.
        self._crc_pool.shutdown(wait=True, cancel_futures=True)
