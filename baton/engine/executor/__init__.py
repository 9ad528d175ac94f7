"""Executors: how the EngineCore runs its model workers (see `base.Executor`)."""

from __future__ import annotations

from baton.engine.executor.base import Executor, WorkerDiedError
from baton.engine.models.config import ModelConfig
from baton.engine.worker.model_runner import RunnerConfig

__all__ = ["Executor", "WorkerDiedError", "make_executor"]


def make_executor(
    model_config: ModelConfig, config: RunnerConfig, tensor_parallel_size: int, backend: str
) -> Executor:
    """`backend` "uni": the runner in this process (tensor_parallel_size 1 only); "mp": one
    worker process per rank."""
    if backend == "uni":
        from baton.engine.executor.uniproc import UniProcExecutor

        return UniProcExecutor(model_config, config)
    from baton.engine.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(model_config, config, tensor_parallel_size)
