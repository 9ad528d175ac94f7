"""The KV connector's worker half under tensor parallelism: one per rank, next to its shard.

Each worker process runs a `PullConnector` worker half on its own KV shard, on a thread of its
own (`RankKV`), so that pulls and leases go on while the process computes a step. Rank r of a
decode engine reads from rank r of the prefill engine (`RemotePrefill.for_rank`): both engines
split the KV heads alike, and every shard travels between a pair of processes on its own
connection.

In the EngineCore, `RankedKVWorker` stands for all of them behind the `KVWorkerHalf` interface
the busy loop drives: it publishes each step's `KVConnectorMetadata` to every rank (one message)
and merges what the ranks report. A pull is over when every rank's part is over (it succeeded if
every part did); a lease ends when it ended on every rank (expired if it expired on any). A step
that leases blocks waits until every rank has the lease, so that no reader can ask a rank for a
lease it does not know yet.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from collections.abc import Callable

import torch
import zmq

from baton.engine.executor.base import WorkerDiedError
from baton.engine.executor.messages import RankKVOutput, StartKVConnector
from baton.kv_transfer.base import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    TransferResult,
)
from baton.kv_transfer.connector import PullConnector

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000  # a rank with nothing outstanding checks for its stop this often
_PENDING_POLL_MS = 50  # ... and with leases outstanding, for their expiry (as the core does)
_ACK_TIMEOUT_S = 30.0  # a rank that does not take a lease by then is broken
_ACK_POLL_S = 0.1
_RECEIVE_POLL_MS = 100  # the core's receiving thread checks for its stop this often


# ---- in each worker process -----------------------------------------------------------------


class RankKV:
    """One rank's worker half, on a thread that owns its two sockets."""

    def __init__(
        self, ctx: zmq.Context, start: StartKVConnector, rank: int, kv_cache: torch.Tensor
    ) -> None:
        self.rank = rank
        self.connector = PullConnector(
            start.config.for_rank(rank), KVConnectorRole.WORKER, start.block_size
        )
        self.connector.register_kv_cache(kv_cache)
        self._wake_r, self._wake_w = os.pipe()  # a loader thread's "a pull ended"
        self.connector.wake = self._wake
        self._stopping = threading.Event()
        self._meta = ctx.socket(zmq.SUB)
        self._meta.setsockopt(zmq.SUBSCRIBE, b"")
        self._meta.connect(start.meta_address)
        self._results = ctx.socket(zmq.PUSH)
        self._results.connect(start.results_address)
        self._thread = threading.Thread(target=self._run, name=f"kv-rank{rank}", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self.connector.ports[0]

    def _wake(self) -> None:
        os.write(self._wake_w, b"\0")

    def stop(self) -> None:
        self._stopping.set()
        self._wake()
        self._thread.join(timeout=5)
        self.connector.shutdown()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # a rank that cannot move its shard takes the engine down
            logger.exception("rank %d: the KV connector failed; the worker exits", self.rank)
            os._exit(1)
        finally:
            self._meta.close(linger=0)
            self._results.close(linger=1000)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._meta, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        connector, acked = self.connector, 0
        while not self._stopping.is_set():
            timeout = _PENDING_POLL_MS if connector.has_pending() else _IDLE_POLL_MS
            events = dict(poller.poll(timeout))
            if self._wake_r in events:
                os.read(self._wake_r, 4096)
            leased = False
            while self._meta.poll(0):
                acked, meta = pickle.loads(self._meta.recv())
                connector.start_load_kv(meta)
                leased = leased or bool(meta.leases)
            output = connector.get_finished()
            if output or leased:
                self._results.send(pickle.dumps(RankKVOutput(self.rank, acked, output)))


# ---- in the EngineCore ----------------------------------------------------------------------


class RankedKVWorker:
    """Every rank's worker half behind the one interface the busy loop drives."""

    def __init__(
        self, ctx: zmq.Context, meta: zmq.Socket, results_address: str, num_ranks: int
    ) -> None:
        self.ports: list[int] = []  # set once every rank has started
        self.transport_name = ""
        self.wake: Callable[[], None] | None = None
        self.check_health: Callable[[], None] = lambda: None  # raises if a rank is gone
        self._n = num_ranks
        self._meta = meta  # XPUB, every rank subscribed; used by the busy loop alone
        self._seq = 0
        self._loads: dict[str, list[tuple[int, TransferResult]]] = {}
        self._leases: dict[str, list[bool]] = {}  # req id -> per rank: expired?
        self._lock = threading.Condition()
        self._received: list[RankKVOutput] = []
        self._acked = [0] * num_ranks
        self._stopping = threading.Event()
        self._error: BaseException | None = None  # the receiving thread died of it
        results = ctx.socket(zmq.PULL)
        results.bind(results_address)
        self._thread = threading.Thread(
            target=self._receive, args=(results,), name="kv-ranks", daemon=True
        )
        self._thread.start()

    def _receive(self, sock: zmq.Socket) -> None:
        try:
            while not self._stopping.is_set():
                if not sock.poll(_RECEIVE_POLL_MS):
                    continue
                msg = pickle.loads(sock.recv())
                with self._lock:
                    self._received.append(msg)
                    self._acked[msg.rank] = max(self._acked[msg.rank], msg.acked)
                    self._lock.notify_all()
                self._wake()
        except BaseException as exc:  # pulls would never end: the engine must stop instead
            logger.exception("the KV results of the ranks can no longer be read")
            self._error = exc
            self._wake()
        finally:
            sock.close(linger=0)

    def _wake(self) -> None:
        wake = self.wake
        if wake is not None:
            wake()

    def _check(self) -> None:
        if self._error is not None:
            raise WorkerDiedError(f"the ranks' KV results cannot be read: {self._error!r}")

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        self._check()
        self._seq += 1
        for spec in metadata.loads:
            self._loads[spec.req_id] = []
        for lease in metadata.leases:
            self._leases[lease.req_id] = []
        self._meta.send(pickle.dumps((self._seq, metadata), protocol=pickle.HIGHEST_PROTOCOL))
        if metadata.leases:
            self._wait_acked(self._seq)

    def _wait_acked(self, seq: int) -> None:
        deadline = time.monotonic() + _ACK_TIMEOUT_S
        with self._lock:
            while min(self._acked) < seq:
                self._check()
                if time.monotonic() > deadline:
                    raise WorkerDiedError(
                        f"a tensor-parallel rank did not take its KV leases within "
                        f"{_ACK_TIMEOUT_S:.0f} s"
                    )
                self.check_health()  # a dead rank ends the wait at once
                self._lock.wait(_ACK_POLL_S)

    def get_finished(self) -> KVConnectorOutput:
        self._check()
        with self._lock:
            received, self._received = self._received, []
        merged = KVConnectorOutput()
        for msg in received:
            out = msg.output
            for result in out.finished_loads:
                parts = self._loads.get(result.req_id)
                if parts is None:
                    logger.warning("rank %d ended an unknown pull %s", msg.rank, result.req_id)
                    continue
                parts.append((msg.rank, result))
                if len(parts) == self._n:
                    del self._loads[result.req_id]
                    merged.finished_loads.append(_merge(parts))
            for req_id, expired in [(r, False) for r in out.claimed_leases] + [
                (r, True) for r in out.expired_leases
            ]:
                ends = self._leases.get(req_id)
                if ends is None:
                    continue
                ends.append(expired)
                if len(ends) == self._n:
                    del self._leases[req_id]
                    ended = merged.expired_leases if any(ends) else merged.claimed_leases
                    ended.append(req_id)
        return merged

    def has_pending(self) -> bool:
        return bool(self._loads or self._leases or self._received)

    def shutdown(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)


def _merge(parts: list[tuple[int, TransferResult]]) -> TransferResult:
    """One pull from its per-rank parts: ok if every part is, else failed with the error of the
    lowest failed rank."""
    failed = sorted((rank, r.error or "FAILED") for rank, r in parts if not r.ok)
    error = f"{failed[0][1]} (rank {failed[0][0]})" if failed else None
    total = sum(r.num_bytes for _, r in parts)
    seconds = max(r.seconds for _, r in parts)
    return TransferResult(parts[0][1].req_id, not failed, error, total, seconds)
