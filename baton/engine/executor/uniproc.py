"""The in-process executor: one `ModelRunner` in the EngineCore's own process (no parallelism)."""

from __future__ import annotations

from baton.engine.executor.base import Executor
from baton.engine.models.config import ModelConfig
from baton.engine.scheduler.output import SchedulerOutput
from baton.engine.worker.model_runner import ModelRunner, PendingOutput, RunnerConfig
from baton.kv_transfer.base import KVConnectorRole, KVTransferConfig
from baton.kv_transfer.connector import PullConnector


class UniProcExecutor(Executor):
    """Calls the runner directly: the path of `tensor_parallel_size` 1, with nothing in between."""

    def __init__(self, model_config: ModelConfig, config: RunnerConfig) -> None:
        self.runner = ModelRunner(model_config, config)

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def device_memory(self) -> tuple[int, int, int] | None:
        return self.runner.device_memory()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def start_kv_transfer(self, config: KVTransferConfig, block_size: int) -> PullConnector:
        worker = PullConnector(config, KVConnectorRole.WORKER, block_size)
        assert self.runner.kv_cache is not None, "allocate_kv_cache first"
        worker.register_kv_cache(self.runner.kv_cache)
        return worker

    def execute_model_async(self, out: SchedulerOutput) -> PendingOutput:
        return self.runner.execute_model_async(out)
