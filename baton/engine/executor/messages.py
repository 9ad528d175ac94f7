"""The messages between the multiprocess executor and its workers, defined once for both sides.

They travel pickled: a step is a `SchedulerOutput`, published once to every rank; the other
messages set up, report and stop. Pickle and not msgspec because the step's dataclasses are
the scheduler's own (no wire copies to keep in sync) and, at the tiny model's batch sizes, a
pickled `SchedulerOutput` costs a few microseconds to encode and decode.
"""

from __future__ import annotations

from dataclasses import dataclass

from baton.engine.models.config import ModelConfig
from baton.engine.worker.model_runner import RunnerConfig
from baton.kv_transfer.base import KVConnectorOutput, KVTransferConfig

# ---- core -> every worker (published) --------------------------------------------------------


@dataclass(frozen=True)
class AllocateKVCache:
    num_blocks: int


@dataclass(frozen=True)
class Shutdown:
    pass


# ---- worker -> core --------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerReady:
    """The rank loaded its shard of the model and subscribed to the steps."""

    rank: int
    kv_bytes_per_block: int  # of this rank's shard of a block
    device_memory: tuple[int, int, int] | None  # ModelRunner.device_memory(); None on CPU


@dataclass(frozen=True)
class KVCacheReady:
    rank: int


@dataclass(frozen=True)
class WorkerFailed:
    """Sent by a worker just before it exits on an error."""

    rank: int
    error: str


# ---- the worker's start-up arguments (its stdin) ----------------------------------------------


@dataclass(frozen=True)
class WorkerConfig:
    rank: int
    world_size: int
    init_method: str  # torch.distributed's rendezvous, tcp://127.0.0.1:PORT
    model_config: ModelConfig
    runner_config: RunnerConfig  # its device is the device type; rank r takes device r
    step_address: str  # the executor publishes steps here (ZMQ SUB connects)
    result_address: str  # workers PUSH their messages here
    parent_pid: int  # the EngineCore: a worker whose parent is gone exits
    num_threads: int  # torch intra-op threads
    log_level: int


# ---- the KV connector's worker half, one per rank (baton/engine/executor/kv_ranks.py) ---------


@dataclass(frozen=True)
class StartKVConnector:
    """Published like a step: every rank starts its worker half on its KV shard."""

    config: KVTransferConfig  # rank 0's; each rank takes `config.for_rank(rank)`
    block_size: int
    meta_address: str  # the core publishes each step's `KVConnectorMetadata` here
    results_address: str  # ranks PUSH their `RankKVOutput`s here


@dataclass(frozen=True)
class KVConnectorReady:
    rank: int
    port: int  # where this rank serves its shard
    transport: str


@dataclass(frozen=True)
class RankKVOutput:
    """What one rank's worker half reports: its ended pulls and leases, and the last
    metadata it has acted on (`acked`), so that the core knows a lease is being served."""

    rank: int
    acked: int
    output: KVConnectorOutput
