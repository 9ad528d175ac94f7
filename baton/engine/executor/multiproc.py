"""The multiprocess executor: one worker process per tensor-parallel rank, kept in lockstep.

Each step is pickled once and published on a ZMQ XPUB socket that every rank subscribes to (one
message per step, whatever the number of ranks); every rank runs it, and rank 0 pushes back
the `ModelRunnerOutput`. Steps and outputs are in order, so with async scheduling a second step
can be published before the first one's tokens are read.

A worker that dies must take the engine down, never hang it: every wait polls the workers'
process handles (pidfds) next to the result socket, and raises `WorkerDiedError` as soon as one
exits. The workers are started with `subprocess` rather than `multiprocessing` because the
EngineCore process is itself a daemonic `multiprocessing` child, which may not have children.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import TypeVar

import zmq

from baton.engine.executor.base import Executor, WorkerDiedError
from baton.engine.executor.kv_ranks import RankedKVWorker
from baton.engine.executor.messages import (
    AllocateKVCache,
    KVCacheReady,
    KVConnectorReady,
    Shutdown,
    StartKVConnector,
    WorkerConfig,
    WorkerFailed,
    WorkerReady,
)
from baton.engine.models.config import ModelConfig
from baton.engine.scheduler.output import ModelRunnerOutput, SchedulerOutput
from baton.engine.worker.model_runner import PendingOutput, RunnerConfig
from baton.kv_transfer.base import KVTransferConfig
from baton.ports import free_port

logger = logging.getLogger(__name__)

_START_TIMEOUT = 1800.0  # loading a real model's shard can take minutes
_POLL_MS = 100  # where no pidfd tells of a worker's exit at once, check this often
_KV_START_TIMEOUT = 120.0  # every rank registers its KV shard with the transport
_STOP_GRACE = 1.0  # seconds a worker gets to leave on Shutdown before it is killed
_PEER_GRACE = 2.0  # seconds to see a peer's death behind a rank's failure report


_Ready = TypeVar("_Ready", WorkerReady, KVConnectorReady)


def _exited(rank: int, proc: subprocess.Popen[bytes], code: int, more: str) -> WorkerDiedError:
    return WorkerDiedError(
        f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}{more}"
    )


def _bind_xpub(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A socket every rank subscribes to. XPUB, not PUB: it hands us each subscription, so we
    know when every rank listens (a PUB socket drops what it sends before a subscriber has
    joined)."""
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per rank
    sock.setsockopt(zmq.SNDHWM, 0)  # never drop a message
    sock.bind(address)
    return sock


@dataclass
class _Workers:
    """What must be torn down, kept apart from the executor so a finalizer can do it."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    pidfds: list[int] = field(default_factory=list)
    ctx: zmq.Context = field(default_factory=zmq.Context)
    tmp: tempfile.TemporaryDirectory[str] = field(
        default_factory=lambda: tempfile.TemporaryDirectory(prefix="baton-workers-")
    )

    def stop(self, steps: zmq.Socket | None) -> None:
        if steps is not None and not steps.closed and any(p.poll() is None for p in self.procs):
            steps.send(pickle.dumps(Shutdown()))
        deadline = time.monotonic() + _STOP_GRACE
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()  # it may be stuck in a collective with a dead peer
                proc.wait()
        for fd in self.pidfds:
            os.close(fd)
        self.pidfds.clear()
        self.ctx.destroy(linger=0)
        self.tmp.cleanup()


class _Step:
    """One published step; `result()` reads rank 0's output for it."""

    def __init__(self, executor: MultiprocExecutor, index: int) -> None:
        self._executor = executor
        self._index = index
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._executor._wait_output(self._index)
        return self._output


class MultiprocExecutor(Executor):
    def __init__(
        self,
        model_config: ModelConfig,
        config: RunnerConfig,
        tensor_parallel_size: int,
        start_timeout: float = _START_TIMEOUT,
    ) -> None:
        self.tensor_parallel_size = n = tensor_parallel_size
        self._workers = workers = _Workers()
        self._finalizer = weakref.finalize(self, workers.stop, None)
        ctx, base = workers.ctx, f"ipc://{workers.tmp.name}"
        self._steps = _bind_xpub(ctx, f"{base}/steps")
        self._results = ctx.socket(zmq.PULL)
        self._results.bind(f"{base}/results")
        self._poller = zmq.Poller()
        self._poller.register(self._results, zmq.POLLIN)
        self._base = base
        self._published = 0  # steps published so far
        self._received = 0  # outputs read so far
        self._outputs: dict[int, ModelRunnerOutput] = {}
        init_method = f"tcp://127.0.0.1:{free_port()}"
        threads = max(1, len(os.sched_getaffinity(0)) // n)  # the CPUs this engine may use
        env = dict(os.environ)
        # The workers import baton as this process does, wherever it came from.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            for rank in range(n):
                wc = WorkerConfig(
                    rank=rank,
                    world_size=n,
                    init_method=init_method,
                    model_config=model_config,
                    runner_config=config,
                    step_address=f"{base}/steps",
                    result_address=f"{base}/results",
                    parent_pid=os.getpid(),
                    num_threads=threads,
                    log_level=logging.getLogger().getEffectiveLevel(),
                )
                proc = subprocess.Popen(
                    [sys.executable, "-m", "baton.engine.executor.worker_proc"],
                    stdin=subprocess.PIPE,
                    env=env,
                )
                workers.procs.append(proc)
                assert proc.stdin is not None
                proc.stdin.write(pickle.dumps(wc))
                proc.stdin.close()
                if hasattr(os, "pidfd_open"):  # readable once the process exits
                    fd = os.pidfd_open(proc.pid)
                    workers.pidfds.append(fd)
                    self._poller.register(fd, zmq.POLLIN)
            # Every rank has loaded its shard and subscribed to the steps.
            ready = self._gather(WorkerReady, self._steps, start_timeout)
        except BaseException:
            self.shutdown()
            raise
        self._kv_bytes_per_block = ready[0].kv_bytes_per_block
        memories = [r.device_memory for r in ready.values() if r.device_memory is not None]
        # Every rank holds its shard of each block: the budget must fit the tightest rank, so
        # take the least free, the smallest device and the most held of any rank.
        self._device_memory = (
            (min(m[0] for m in memories), min(m[1] for m in memories), max(m[2] for m in memories))
            if memories
            else None
        )
        logger.info("%d workers ready (pids %s)", n, [p.pid for p in workers.procs])

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers.procs]

    def _gather(self, kind: type[_Ready], xpub: zmq.Socket, timeout: float) -> dict[int, _Ready]:
        """One `kind` message from every rank, and every rank subscribed to `xpub`."""
        n = self.tensor_parallel_size
        got: dict[int, _Ready] = {}
        subscribed = 0
        self._poller.register(xpub, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        try:
            while len(got) < n or subscribed < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the workers were not ready within {timeout:.0f} s")
                events = dict(self._poller.poll(_POLL_MS))
                if xpub in events:
                    if xpub.recv()[:1] == b"\x01":
                        subscribed += 1
                    continue
                if self._results in events:
                    msg = self._read()
                    if not isinstance(msg, kind):
                        got_kind, want = type(msg).__name__, kind.__name__
                        raise RuntimeError(f"a worker sent {got_kind}, not {want}")
                    got[msg.rank] = msg
                    continue
                self.check_health()
        finally:
            self._poller.unregister(xpub)
        return got

    # ---- the Executor interface ----------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        return self._kv_bytes_per_block

    def device_memory(self) -> tuple[int, int, int] | None:
        return self._device_memory

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._publish(AllocateKVCache(num_blocks))
        acks: set[int] = set()
        while len(acks) < self.tensor_parallel_size:
            msg = self._recv()
            if not isinstance(msg, KVCacheReady):
                raise RuntimeError(f"a worker sent {type(msg).__name__} instead of KV READY")
            acks.add(msg.rank)

    def start_kv_transfer(self, config: KVTransferConfig, block_size: int) -> RankedKVWorker:
        """Every rank starts the connector's worker half on its shard, on its own port."""
        meta = _bind_xpub(self._workers.ctx, f"{self._base}/kv-meta")
        results = f"{self._base}/kv-results"
        proxy = RankedKVWorker(self._workers.ctx, meta, results, self.tensor_parallel_size)
        proxy.check_health = self.check_health
        self._publish(StartKVConnector(config, block_size, f"{self._base}/kv-meta", results))
        try:
            ready = self._gather(KVConnectorReady, meta, _KV_START_TIMEOUT)
        except BaseException:
            proxy.shutdown()
            raise
        proxy.ports = [ready[r].port for r in range(self.tensor_parallel_size)]
        proxy.transport_name = ready[0].transport
        return proxy

    def execute_model_async(self, out: SchedulerOutput) -> _Step | PendingOutput:
        if not (out.total_num_scheduled_tokens or out.finished_req_ids):
            return PendingOutput.empty()  # nothing for the workers
        self._publish(out)
        self._published += 1
        return _Step(self, self._published - 1)

    def check_health(self) -> None:
        for rank, proc in enumerate(self._workers.procs):
            code = proc.poll()
            if code is not None:
                reason = self._failure_reason()
                raise _exited(rank, proc, code, f": {reason}" if reason else "")

    def shutdown(self) -> None:
        if self._finalizer.alive:
            self._finalizer.detach()
            self._workers.stop(self._steps if hasattr(self, "_steps") else None)

    # ---- messages ------------------------------------------------------------------------

    def _publish(self, msg: object) -> None:
        self._steps.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def _read(self) -> object:
        msg = pickle.loads(self._results.recv())
        if isinstance(msg, WorkerFailed):
            raise self._failed(msg)
        return msg

    def _failed(self, failed: WorkerFailed) -> WorkerDiedError:
        """The error for a rank's failure report. A collective that breaks because a peer
        was killed fails on the survivors too, often before the peer's exit is seen: a peer
        killed by a signal within a short grace is named as the cause."""
        deadline = time.monotonic() + _PEER_GRACE
        while True:
            for rank, proc in enumerate(self._workers.procs):
                code = proc.poll()
                if rank != failed.rank and code is not None and code < 0:
                    return _exited(
                        rank, proc, code, f"; rank {failed.rank} then failed: {failed.error}"
                    )
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        return WorkerDiedError(f"tensor-parallel worker rank {failed.rank} failed: {failed.error}")

    def _recv(self) -> object:
        """The next message from a worker; raises as soon as one is gone."""
        while True:
            events = dict(self._poller.poll(_POLL_MS))
            if self._results in events:
                return self._read()
            self.check_health()

    def _wait_output(self, index: int) -> ModelRunnerOutput:
        while index not in self._outputs:
            msg = self._recv()
            if not isinstance(msg, ModelRunnerOutput):
                raise RuntimeError(f"rank 0 sent {type(msg).__name__} instead of a step output")
            self._outputs[self._received] = msg
            self._received += 1
        # Outputs of older steps nobody asked for (a step that only dropped finished
        # requests, under async scheduling) are dropped too: outputs are read in order.
        for stale in [i for i in self._outputs if i < index]:
            del self._outputs[stale]
        return self._outputs.pop(index)

    def _failure_reason(self) -> str | None:
        """What a worker said before it exited, if it said anything."""
        while self._results.poll(0):
            msg = pickle.loads(self._results.recv())
            if isinstance(msg, WorkerFailed):
                return msg.error
        return None
