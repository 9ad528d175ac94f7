"""TCP transfers staged through host buffers: how the TCP transport moves a KV cache that lives in
device memory, and, when forced (``KVTransferConfig.staging = "always"``), one in host memory, so
that CPU-only CI runs the same logic.

A `Stager` owns two host buffers of one chunk each. The sender copies the next chunk of blocks from
the cache into one buffer while the socket sends the other; the reader receives a chunk into one
buffer, checksums it there (the staged bytes, against the same per-block values the direct path
checks) and copies it into the cache while the next chunk arrives in the other. On CUDA the buffers
are pinned and each copy runs on a side stream, ended by an event; elsewhere a copy runs on one
helper thread (torch's copy and the socket calls both release the GIL), so the overlap is real on
CPU too.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from baton.kv_transfer.checksum import block_bytes, block_checksum
from baton.kv_transfer.tcp.wire import coalesce

# One staging chunk. On CPU, 512 KiB to 4 MiB chunks moved a 16 MiB read within 10% of each
# other (1.0 GB/s, staged on both sides, one process); 2 MiB keeps the per-chunk Python work
# and each GPU copy's launch small beside the copy, with 4 MiB of buffers per transfer.
STAGE_CHUNK_BYTES = 2 << 20
_IDLE_STAGERS = 4  # kept for reuse per pool: pinned allocations are slow on CUDA

Runs = list[tuple[int, int]]  # (first block id, count)
Wait = Callable[[], None]


def uses_staging(kv_cache: torch.Tensor, mode: str) -> bool:
    """Whether TCP stages this cache's blocks: always for device memory, and for host memory
    when ``mode`` is "always" (``KVTransferConfig.staging``)."""
    return mode == "always" or kv_cache.device.type != "cpu"


def block_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes as ``[num_blocks, block_bytes]`` uint8 on its own device (no copy)."""
    if not kv_cache.is_contiguous() or kv_cache.dim() < 1:
        raise ValueError(
            f"kv_cache must be a contiguous tensor [num_blocks, ...], got "
            f"contiguous={kv_cache.is_contiguous()} shape={tuple(kv_cache.shape)}"
        )
    return kv_cache.detach().reshape(kv_cache.shape[0], -1).view(torch.uint8)


def plan_chunks(block_ids: list[int], per_chunk: int) -> list[Runs]:
    """``block_ids`` in order, cut into chunks of at most ``per_chunk`` blocks, each as its
    runs of consecutive ids."""
    return [coalesce(block_ids[i : i + per_chunk]) for i in range(0, len(block_ids), per_chunk)]


def _copy_all(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in copies:
        dst.copy_(src)


class _Copier:
    """Runs a batch of copies in the background; ``start`` returns the wait for it."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._stream = (
            torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            if self._cuda
            else None
        )
        self._thread = None if self._cuda else ThreadPoolExecutor(1, thread_name_prefix="kv-stage")

    def start(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> Wait:
        """Copies each (dst, src) pair. On CUDA no wait for the current stream: the sender's
        blocks were written by a step whose outputs the host already read, and the reader's
        blocks are not read by any step before its pull reports."""
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                for dst, src in copies:
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self._stream)
            return event.synchronize
        assert self._thread is not None
        future = self._thread.submit(_copy_all, copies)
        return future.result

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)


class Stager:
    """Two host buffers of one chunk and a copier, used by one transfer at a time."""

    def __init__(self, rows: torch.Tensor, per_chunk: int) -> None:
        self.rows = rows  # [num_blocks, block_bytes] uint8
        self.per_chunk = per_chunk
        pin = rows.device.type == "cuda"
        # [per_chunk, block_bytes] uint8 each
        self._bufs = [
            torch.empty((per_chunk, rows.shape[1]), dtype=torch.uint8, pin_memory=pin)
            for _ in range(2)
        ]
        self._views = [b.numpy().data.cast("B") for b in self._bufs]
        self._copier = _Copier(rows.device)

    def _load(self, i: int, runs: Runs) -> Wait:
        """Starts copying ``runs`` of the cache into buffer ``i``, in order."""
        copies, at = [], 0
        for first, count in runs:
            copies.append((self._bufs[i][at : at + count], self.rows[first : first + count]))
            at += count
        return self._copier.start(copies)

    def _store(self, i: int, runs: Runs) -> Wait:
        """Starts copying buffer ``i`` into ``runs`` of the cache, in order."""
        copies, at = [], 0
        for first, count in runs:
            copies.append((self.rows[first : first + count], self._bufs[i][at : at + count]))
            at += count
        return self._copier.start(copies)

    def send(self, sock: socket.socket, block_ids: list[int]) -> None:
        """Sends the blocks' bytes in order; the copy of chunk k+1 overlaps the send of chunk k."""
        bpb = self.rows.shape[1]
        plan = plan_chunks(block_ids, self.per_chunk)
        if not plan:
            return
        pending: Wait | None = self._load(0, plan[0])
        try:
            for k, runs in enumerate(plan):
                assert pending is not None
                wait, pending = pending, None
                wait()
                # Buffer (k+1)%2 was sent by chunk k-1's sendall, which returned: it is free.
                if k + 1 < len(plan):
                    pending = self._load((k + 1) % 2, plan[k + 1])
                sock.sendall(self._views[k % 2][: sum(c for _, c in runs) * bpb])
        finally:
            if pending is not None:
                pending()  # a failed send leaves no copy running into a buffer

    def receive(self, block_ids: list[int], recv_into: Callable[[memoryview], None]) -> list[int]:
        """Receives the blocks' bytes (``recv_into`` fills a whole buffer or raises) into the
        cache rows ``block_ids``, in order, and returns the checksum of each block as staged;
        the copy of chunk k into the cache overlaps the receive of chunk k+1. Every copy has
        ended when it returns or raises."""
        bpb = self.rows.shape[1]
        pending: list[Wait | None] = [None, None]
        crcs: list[int] = []
        try:
            for k, runs in enumerate(plan_chunks(block_ids, self.per_chunk)):
                i = k % 2
                wait, pending[i] = pending[i], None
                if wait is not None:
                    wait()  # chunk k-2's copy out of this buffer
                n = sum(c for _, c in runs)
                view = self._views[i]
                recv_into(view[: n * bpb])
                crcs.extend(block_checksum(view[b * bpb : (b + 1) * bpb]) for b in range(n))
                pending[i] = self._store(i, runs)
        finally:
            for wait in pending:
                if wait is not None:
                    wait()
        return crcs

    def close(self) -> None:
        self._copier.close()


class StagingPool:
    """Stagers for one KV cache, one per concurrent transfer, kept for reuse."""

    def __init__(self, kv_cache: torch.Tensor, chunk_bytes: int = STAGE_CHUNK_BYTES) -> None:
        self.rows = block_rows(kv_cache)
        self.per_chunk = max(1, chunk_bytes // block_bytes(kv_cache))
        self._idle: list[Stager] = []
        self._lock = threading.Lock()
        self._closed = False

    @contextlib.contextmanager
    def stager(self) -> Iterator[Stager]:
        with self._lock:
            stager = self._idle.pop() if self._idle else None
        if stager is None:
            stager = Stager(self.rows, self.per_chunk)
        try:
            yield stager
        finally:
            with self._lock:
                keep = not self._closed and len(self._idle) < _IDLE_STAGERS
                if keep:
                    self._idle.append(stager)
            if not keep:
                stager.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
        for stager in idle:
            stager.close()
