"""The executor: how the EngineCore runs its workers, in this process or in one per rank.

The EngineCore sees one interface whatever the parallel layout: it asks for the KV cache's bytes
per block (one rank's shard of a block), tells every rank how many blocks to allocate, and hands
each `SchedulerOutput` to `execute_model`; the sampled tokens come back as a `ModelRunnerOutput`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from baton.engine.scheduler.output import ModelRunnerOutput, SchedulerOutput
from baton.kv_transfer.base import KVTransferConfig, KVWorkerHalf


class WorkerDiedError(RuntimeError):
    """A worker process exited or failed: the engine cannot run another step."""


class StepResult(Protocol):
    """A step handed to the workers; `result()` waits for its sampled tokens (once or more)."""

    def result(self) -> ModelRunnerOutput: ...


class Executor(ABC):
    """Runs the model's workers. Not thread-safe: the busy loop alone calls it."""

    @abstractmethod
    def kv_bytes_per_block(self) -> int:
        """Bytes of one KV block on one rank (its shard of the KV heads)."""

    @abstractmethod
    def device_memory(self) -> tuple[int, int, int] | None:
        """(free, total, held by the engine) bytes of the most constrained rank's device after
        loading the model; None on CPU."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Every rank allocates its shard of `num_blocks` KV blocks; returns when all have."""

    @abstractmethod
    def start_kv_transfer(self, config: KVTransferConfig, block_size: int) -> KVWorkerHalf:
        """Starts the KV connector's worker half next to every rank's KV shard (after
        `allocate_kv_cache`); rank r serves its shard on the returned `ports[r]`."""

    @abstractmethod
    def execute_model_async(self, out: SchedulerOutput) -> StepResult:
        """Starts one step on every rank and returns without waiting for its tokens."""

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step and waits for its sampled tokens."""
        return self.execute_model_async(out).result()

    def check_health(self) -> None:  # noqa: B027 - a no-op default: no workers to lose
        """Raises `WorkerDiedError` if a worker is gone. Cheap; never blocks."""

    def shutdown(self) -> None:  # noqa: B027 - a no-op default: no workers to stop
        """Stops the workers; safe to call more than once."""
