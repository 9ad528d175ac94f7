"""The serving side's leases, for both transports: which blocks of this engine's KV cache a
reader may take under a request id, until when, with their checksums, and which reads are in
progress.

A lease is made by the busy loop (never blocking: the blocks' checksums are computed on a
background thread) and ends in one of two ways, both reported back to the busy loop: a reader
claims it (DONE after its read, or a release when it will not read), or its time passes. A lease
being read is never expired under the read: a lookup puts a hold on it, which ends when the read
says so (`end_read`, TCP: the server sends the bytes itself), when the lease is claimed, or at
the hold's own deadline (NIXL: the reader takes the bytes one-sided, and a reader that died must
not pin the blocks forever).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from baton.kv_transfer.checksum import XXH3, block_bytes, block_crcs
from baton.tracing import log_for

logger = logging.getLogger(__name__)
MAX_HOLD_S = 30.0  # longest a lookup protects a lease from expiry
_EXPIRED_MEMORY = 4096  # expired ids remembered, so a late reader hears EXPIRED


class Status(enum.IntEnum):
    """The serving side's answer to a reader; a reader reports the name of a non-OK status."""

    OK = 0
    UNKNOWN_ENGINE = 1  # engine_id differs: the engine at this address restarted, its memory is new
    UNKNOWN_REQUEST = 2  # no lease under this request id (never leased, released, or already done)
    EXPIRED = 3  # the lease passed its expiry time
    BAD_BLOCKS = 4  # asked ids are not among the leased ones, or out of range
    BLOCK_SIZE_MISMATCH = 5  # the two caches' blocks have different byte sizes
    BAD_REQUEST = 6  # malformed request
    UNAUTHORIZED = 7  # the peer did not prove the hand-off key (keyring.py)


def status_name(status: int) -> str:
    """The name a reader reports for a status code, including one this version does not know."""
    try:
        return Status(status).name
    except ValueError:
        return f"STATUS_{status}"


@dataclass(frozen=True)
class _Lease:
    block_ids: frozenset[int]
    expires_at: float  # Unix time, seconds
    crcs: Future[list[int]]  # per block, in sorted id order; computed off the busy loop
    client_request_id: str | None  # the client's id of the request, for the lease's log lines


@dataclass
class _Hold:
    reads: int  # lookups whose read has not said it ended
    until: float  # monotonic time; the hold ends then whatever the reads say


class LeaseTable:
    """The leases of one engine's KV cache; thread-safe, and no call blocks on I/O. Readers name
    the engine id and block size they expect, which a restarted engine or another layout refuses."""

    def __init__(self, kv_cache: torch.Tensor, engine_id: str, checksum: str = XXH3) -> None:
        self.engine_id = engine_id
        self.checksum = checksum  # the kind of block checksum readers are given (checksum.py)
        self.block_bytes = block_bytes(kv_cache)
        self._kv = kv_cache
        self._num_blocks = kv_cache.shape[0]
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._claimed: list[str] = []
        self._holds: dict[str, _Hold] = {}
        self.reading = threading.Event()  # set while any hold is active
        # One worker: checksumming is background work and must not crowd out the engine.
        self._crc_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-crc")

    # ---- the busy loop's side

    def lease(
        self,
        request_id: str,
        block_ids: list[int],
        expires_at: float,
        client_request_id: str | None = None,
    ) -> None:
        """Makes `block_ids` readable under `request_id` until `expires_at` (Unix time);
        `client_request_id` names the client's request in the lease's log lines."""
        bad = [b for b in block_ids if not 0 <= b < self._num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:8]} out of range [0, {self._num_blocks})")
        ids = sorted(set(block_ids))
        crcs = self._crc_pool.submit(block_crcs, self._kv, ids, self.checksum)
        with self._lock:
            self._leases[request_id] = _Lease(frozenset(ids), expires_at, crcs, client_request_id)
            self._expired.pop(request_id, None)
        log_for(
            client_request_id, logger, logging.DEBUG, "KV lease %s: %d blocks", request_id, len(ids)
        )

    def release(self, request_id: str) -> bool:
        """Drops a lease without reporting it; False when there was none."""
        with self._lock:
            self._drop_hold(request_id)
            lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        log_for(lease.client_request_id, logger, logging.DEBUG, "KV lease %s released", request_id)
        return True

    def expire(self, now: float) -> list[str]:
        """Drops the leases whose time passed (not those held by a read) and returns them."""
        with self._lock:
            self._drop_stale_holds()
            gone = [
                rid
                for rid, lease in self._leases.items()
                if lease.expires_at < now and rid not in self._holds
            ]
            ended = [(rid, self._leases.pop(rid)) for rid in gone]
            for rid in gone:
                self._expired[rid] = None
            while len(self._expired) > _EXPIRED_MEMORY:
                self._expired.popitem(last=False)
        for rid, lease in ended:
            log_for(lease.client_request_id, logger, logging.DEBUG, "KV lease %s expired", rid)
        return gone

    def claimed(self) -> list[str]:
        """Leases claimed by readers since the last call."""
        with self._lock:
            claimed, self._claimed = self._claimed, []
        return claimed

    # ---- the readers' side

    def lookup(
        self, engine_id: str, request_id: str, ids: list[int], block_bytes: int, hold_s: float
    ) -> tuple[Status, list[int]]:
        """(OK, the checksum of each asked block, in the order asked) and a hold on the lease
        for at most `hold_s`, or (the refusal, [])."""
        if engine_id != self.engine_id:
            return Status.UNKNOWN_ENGINE, []
        if block_bytes != self.block_bytes:
            return Status.BLOCK_SIZE_MISMATCH, []
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                expired = request_id in self._expired
                return (Status.EXPIRED if expired else Status.UNKNOWN_REQUEST), []
            # Checked here too, not only in expire(): the engine sweeps once per step at best.
            if lease.expires_at < time.time():
                return Status.EXPIRED, []
            # A subset is fine: the reader may already hold a prefix of the prompt's blocks.
            if not ids or not lease.block_ids.issuperset(ids):
                return Status.BAD_BLOCKS, []
            until = time.monotonic() + min(max(hold_s, 0.0), MAX_HOLD_S)
            hold = self._holds.setdefault(request_id, _Hold(0, until))
            hold.reads += 1
            hold.until = max(hold.until, until)
            self.reading.set()
        log_for(
            lease.client_request_id, logger, logging.DEBUG,
            "serving KV lease %s: %d of its %d blocks", request_id, len(ids), len(lease.block_ids),
        )  # fmt: skip
        # Not waiting on an unfinished background pass: it may be queued behind other leases.
        fut = lease.crcs
        if fut.done() and not fut.cancelled():
            table = dict(zip(sorted(lease.block_ids), fut.result(), strict=True))
            return Status.OK, [table[b] for b in ids]
        return Status.OK, block_crcs(self._kv, ids, self.checksum)

    def end_read(self, request_id: str) -> None:
        """A read that began with `lookup` is over (whether or not it was claimed)."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is not None:
                hold.reads -= 1
                if hold.reads <= 0:
                    self._drop_hold(request_id)

    def claim(self, engine_id: str, request_id: str) -> Status:
        """Done or released by a reader: on OK the lease is gone and reported claimed."""
        if engine_id != self.engine_id:
            return Status.UNKNOWN_ENGINE
        with self._lock:
            self._drop_hold(request_id)
            lease = self._leases.pop(request_id, None)
            if lease is None:
                return Status.UNKNOWN_REQUEST
            self._claimed.append(request_id)
        log_for(
            lease.client_request_id, logger, logging.DEBUG,
            "KV lease %s claimed (read, or released by its reader)", request_id,
        )  # fmt: skip
        return Status.OK

    def holding(self) -> bool:
        """Whether a read may still be in progress (drops holds that ran out)."""
        with self._lock:
            self._drop_stale_holds()
            return bool(self._holds)

    def stop(self) -> None:
        # Waits for at most the one lease's checksum pass in progress.
        self._crc_pool.shutdown(wait=True, cancel_futures=True)

    def _drop_stale_holds(self) -> None:
        mono = time.monotonic()
        for rid in [r for r, hold in self._holds.items() if hold.until < mono]:
            self._drop_hold(rid)

    def _drop_hold(self, request_id: str) -> None:
        self._holds.pop(request_id, None)
        if not self._holds:
            self.reading.clear()
