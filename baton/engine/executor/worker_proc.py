"""A tensor-parallel worker process: one rank's model shard and KV shard, stepping in lockstep.

Started by `MultiprocExecutor` as `python -m baton.engine.executor.worker_proc`, with its
`WorkerConfig` pickled on stdin. It joins the torch.distributed group, loads its shard, says
`WorkerReady`, then runs every `SchedulerOutput` the executor publishes; rank 0 alone sends
back the sampled tokens (every rank samples the same ones). On any error it says
`WorkerFailed` and exits non-zero; when its EngineCore is gone it exits too.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import zmq

from baton import logs
from baton.engine.executor.kv_ranks import RankKV
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
from baton.engine.models.tensor_parallel import TensorParallel
from baton.engine.scheduler.output import SchedulerOutput
from baton.engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_PARENT_POLL_MS = 1000  # how often an idle worker checks that its EngineCore is alive
# A collective that waits longer than this for a peer fails instead of hanging for ever; the
# executor normally notices a dead peer (and stops every rank) long before.
_COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def init_tensor_parallel(config: WorkerConfig, device: torch.device) -> TensorParallel:
    """Joins the process group (NCCL on CUDA, gloo on CPU); a group of one needs none."""
    if config.world_size == 1:
        return TensorParallel()
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=config.init_method,
        rank=config.rank,
        world_size=config.world_size,
        timeout=_COLLECTIVE_TIMEOUT,
    )
    return TensorParallel(config.rank, config.world_size)


def run_worker(config: WorkerConfig) -> None:
    torch.set_num_threads(config.num_threads)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(config.result_address)
    try:
        device = config.runner_config.device
        if device.type == "cuda":
            device = torch.device("cuda", config.rank)
            torch.cuda.set_device(device)
        tp = init_tensor_parallel(config, device)
        runner = ModelRunner(config.model_config, replace(config.runner_config, device=device), tp)
        steps = ctx.socket(zmq.SUB)
        steps.setsockopt(zmq.SUBSCRIBE, b"")
        steps.connect(config.step_address)
        ready = WorkerReady(config.rank, runner.kv_bytes_per_block(), runner.device_memory())
        push.send(pickle.dumps(ready))
        _serve(ctx, config, runner, steps, push)
    except Exception as e:
        logger.exception("worker rank %d failed", config.rank)
        push.send(pickle.dumps(WorkerFailed(config.rank, f"{type(e).__name__}: {e}")))
        push.close(linger=1000)
        sys.exit(1)  # without tearing down the group: a dead peer could make that hang
    if dist.is_initialized():
        dist.destroy_process_group()


def _serve(
    ctx: zmq.Context, config: WorkerConfig, runner: ModelRunner, steps: zmq.Socket, push: zmq.Socket
) -> None:
    send_outputs = config.rank == 0
    kv: RankKV | None = None  # the KV connector's worker half for this rank's shard
    try:
        while True:
            if not steps.poll(_PARENT_POLL_MS):
                if os.getppid() != config.parent_pid:
                    logger.warning("worker rank %d: the engine core is gone; exiting", config.rank)
                    return
                continue
            msg = pickle.loads(steps.recv())
            if isinstance(msg, SchedulerOutput):
                output = runner.execute_model(msg)
                if send_outputs:
                    push.send(pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL))
            elif isinstance(msg, AllocateKVCache):
                runner.allocate_kv_cache(msg.num_blocks)
                push.send(pickle.dumps(KVCacheReady(config.rank)))
            elif isinstance(msg, StartKVConnector):
                assert runner.kv_cache is not None, "the KV cache comes first"
                kv = RankKV(ctx, msg, config.rank, runner.kv_cache)
                ready = KVConnectorReady(config.rank, kv.port, kv.connector.transport_name)
                push.send(pickle.dumps(ready))
            elif isinstance(msg, Shutdown):
                return
            else:
                raise RuntimeError(f"unexpected message {type(msg).__name__}")
    finally:
        if kv is not None:
            kv.stop()


def main() -> None:
    config = pickle.load(sys.stdin.buffer)
    if not isinstance(config, WorkerConfig):
        raise SystemExit(f"expected a WorkerConfig on stdin, got {type(config).__name__}")
    logs.configure(config.log_level, component=f"engine-worker-{config.rank}")
    run_worker(config)


if __name__ == "__main__":
    main()
