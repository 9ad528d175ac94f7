"""EngineCore: owns the scheduler and the executor; `step()` is one turn of the busy loop."""

from __future__ import annotations

import logging
import weakref
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from baton.engine import compatibility
from baton.engine.config import EngineArgs
from baton.engine.executor import Executor, make_executor
from baton.engine.executor.base import StepResult
from baton.engine.executor.uniproc import UniProcExecutor
from baton.engine.kv_cache.manager import KVCacheConfig
from baton.engine.kv_cache.publisher import KVEventPublisher
from baton.engine.models.config import ModelConfig, parse_dtype
from baton.engine.models.loader import weight_files
from baton.engine.models.tensor_parallel import ShardLayout
from baton.engine.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from baton.engine.request import Request, RequestStatus
from baton.engine.scheduler.output import SchedulerOutput
from baton.engine.scheduler.scheduler import Scheduler, SchedulerConfig

if TYPE_CHECKING:
    from baton.engine.structured.manager import StructuredOutputManager
from baton.engine.worker.model_runner import ModelRunner, RunnerConfig
from baton.kv_events import AllBlocksCleared
from baton.kv_transfer.base import KVConnectorRole, KVWorkerHalf
from baton.kv_transfer.connector import PullConnector
from baton.kv_transfer.params import cdiv

logger = logging.getLogger(__name__)

_CPU_KV_CACHE_BYTES = 4 << 30  # like vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE=4)


def kv_budget(free: int, total: int, held: int, gpu_memory_utilization: float) -> int:
    """Bytes of device memory the KV cache may take, as vLLM's --gpu-memory-utilization means it:
    this engine's share of the whole device, less what it already holds (the weights), and never
    more than is free. The share is per engine, so two engines at 0.45 share one GPU whichever
    starts first; what is left outside the shares is headroom for activations."""
    return max(0, min(int(total * gpu_memory_utilization) - held, free))


def resolve_model_path(
    model: str | None, revision: str | None = None, download_dir: str | None = None
) -> Path:
    """The local folder for `--model` (a folder, a GGUF file, a repo id or None): see
    `baton.engine.models.source`."""
    from baton.engine.models.source import resolve_model

    return resolve_model(model, revision, download_dir)


class EngineCore:
    """Owns the scheduler and the executor (the model's workers, here or in worker processes)."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.model_path = resolve_model_path(args.model, args.revision, args.download_dir)
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        mc = self.model_config
        device = _resolve_device(args.device)
        dtype = mc.dtype if args.dtype == "auto" else parse_dtype(args.dtype)
        if device.type == "cpu" and dtype == torch.float16:
            dtype = torch.bfloat16  # CPUs have no fast fp16 matmul; vLLM's CPU build does this
        self.max_model_len = args.max_model_len or mc.max_positions
        if self.max_model_len > mc.max_positions:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's longest sequence, "
                f"{mc.max_positions} (max_position_embeddings {mc.max_position_embeddings} "
                "and its rope scaling)"
            )
        attention = args.attention_backend or ("triton" if device.type == "cuda" else "torch")
        tp = args.tensor_parallel_size
        # A model that does not split, or a fingerprint that cannot be read, says so before any
        # process or socket is started.
        layout = ShardLayout.build(mc, 0, tp)
        # The dtype asked for counts with the one in use: on CPU float16 runs as bfloat16, yet
        # an engine asked for float16 is not the bfloat16 one (on a GPU it would not be).
        resolved = str(dtype).removeprefix("torch.")
        asked = resolved if args.dtype == "auto" else str(parse_dtype(args.dtype))[6:]
        dtype_name = resolved if asked == resolved else f"{resolved} (asked {asked})"
        self.fingerprint = compatibility.compute(
            self.model_path,
            Path(args.tokenizer) if args.tokenizer else self.model_path,
            weight_files(self.model_path),
            dtype=dtype_name,
            kv_cache_dtype=resolved,
            block_size=args.block_size,
            block_shape=(mc.num_layers, 2, args.block_size, layout.num_kv_heads, mc.head_dim),
            tensor_parallel_size=tp,
            chat_template=args.chat_template,
        )
        if device.type == "cuda" and tp > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size {tp} needs {tp} GPUs; {torch.cuda.device_count()} visible"
            )
        self.executor: Executor = make_executor(
            mc,
            RunnerConfig(
                device=device,
                dtype=dtype,
                block_size=args.block_size,
                max_model_len=self.max_model_len,
                attention_backend=attention,
                seed=args.seed,
            ),
            tp,
            args.executor_backend,
        )
        self._in_flight: deque[tuple[SchedulerOutput, StepResult]] = deque()
        try:
            self.num_blocks = self._num_blocks()
            self.executor.allocate_kv_cache(self.num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        # The connector's two halves: the scheduler's (bookkeeping, here) and the worker's (the
        # transport, next to each rank's KV shard: in this process, or one per worker process).
        connector: PullConnector | None = None
        self.connector_worker: KVWorkerHalf | None = None
        if args.kv_transfer is not None:
            kvt = args.kv_transfer
            try:
                self.connector_worker = self.executor.start_kv_transfer(kvt, args.block_size)
                connector = PullConnector(
                    kvt,
                    KVConnectorRole.SCHEDULER,
                    args.block_size,
                    ports=self.connector_worker.ports,
                    fingerprint=self.fingerprint,
                )
            except BaseException:
                if self.connector_worker is not None:
                    self.connector_worker.shutdown()
                self.executor.shutdown()
                raise
        max_batched = args.max_num_batched_tokens or max(8192, self.max_model_len)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=self.max_model_len,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=max_batched,
                policy=args.scheduling_policy,
            ),
            KVCacheConfig(
                num_blocks=self.num_blocks,
                block_size=args.block_size,
                enable_prefix_caching=args.enable_prefix_caching,
                enable_kv_cache_events=args.kv_events_enabled,
                sliding_window=_kv_window(mc),
            ),
            connector,
        )
        self.kv_events: KVEventPublisher | None = None
        if args.kv_events_config is not None and args.kv_events_enabled:
            try:
                self.kv_events = KVEventPublisher(args.kv_events_config)
            except BaseException:
                self.shutdown()
                raise
            # An engine dropped without `shutdown` (an `LLM` collected) frees its ports too.
            weakref.finalize(self, self.kv_events.shutdown)
            # Whatever a subscriber held for this engine (a previous process's) is gone.
            self.kv_events.publish([AllBlocksCleared()])
        logger.info(
            "engine ready: %s on %s (%s), tensor_parallel_size %d, %d KV blocks of %d tokens, "
            "attention=%s",
            mc.architecture,
            device,
            dtype,
            tp,
            self.num_blocks,
            args.block_size,
            attention,
        )

    @property
    def runner(self) -> ModelRunner:
        """The in-process model runner; only the 'uni' executor has one."""
        if not isinstance(self.executor, UniProcExecutor):
            raise AttributeError("the model runs in worker processes: there is no local runner")
        return self.executor.runner

    def _num_blocks(self) -> int:
        """Blocks every rank can hold: the budget is per rank (each holds its shard of a
        block), so the most constrained rank decides."""
        args = self.args
        per_block = self.executor.kv_bytes_per_block()
        memory = self.executor.device_memory()
        needed = cdiv(self.max_model_len, args.block_size)
        if args.num_gpu_blocks_override is not None:  # as given, as vLLM takes it
            num_blocks = args.num_gpu_blocks_override
        else:
            if args.kv_cache_memory_bytes is not None:
                num_blocks = args.kv_cache_memory_bytes // per_block
            elif memory is not None:
                num_blocks = int(kv_budget(*memory, args.gpu_memory_utilization) // per_block)
            else:
                num_blocks = _CPU_KV_CACHE_BYTES // per_block
            # A budget need not be filled past what every sequence at its longest could use.
            num_blocks = min(num_blocks, needed * args.max_num_seqs)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache has {num_blocks} blocks of {args.block_size} tokens, fewer than "
                f"one request of max_model_len {self.max_model_len} needs ({needed}); lower "
                f"max_model_len or give the cache more memory"
            )
        return num_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        req = Request.from_core_request(request, self.model_config.eos_token_ids)
        if req.use_structured_output and self.scheduler.structured is None:
            # Started by the first constrained request, so that an engine never asked for a
            # grammar loads no tokenizer and indexes no vocabulary; built on a thread while
            # that request waits in the scheduler, as it would for its grammar.
            from baton.engine.structured.manager import DeferredManager

            self.scheduler.structured = DeferredManager(self._structured_output_manager)
        self.scheduler.add_request(req)

    def _structured_output_manager(self) -> StructuredOutputManager:
        """The grammar backend over the engine's tokenizer (the tokenizer load and llguidance's
        per-vocabulary set-up: hundreds of ms)."""
        from baton.engine.structured.backend import GrammarCompiler
        from baton.engine.structured.manager import StructuredOutputManager
        from baton.tokenizer import load_tokenizer

        args = self.args
        tokenizer = load_tokenizer(args.tokenizer or self.model_path, args.chat_template)
        mc = self.model_config
        # The mask is as wide as the logits (the model's vocab_size), not the tokenizer's.
        compiler = GrammarCompiler.from_config(
            tokenizer, mc.vocab_size, mc.eos_token_ids, args.structured_outputs_config
        )
        return StructuredOutputManager(compiler)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def has_pending_transfers(self) -> bool:
        """A pull or a lease is outstanding: the loop must keep stepping even when idle."""
        return self.connector_worker is not None and self.connector_worker.has_pending()

    def check_health(self) -> None:
        """Raises `WorkerDiedError` if a worker process is gone."""
        self.executor.check_health()

    def reset_prefix_cache(self) -> bool:
        """Forgets the prefix cache (False, changing nothing, while any block is in use); the
        subscribers of KV events hear of it at once."""
        done = self.scheduler.reset_prefix_cache()
        self._publish_kv_events()
        return done

    def shutdown(self) -> None:
        if self.kv_events is not None:
            self.kv_events.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        self.executor.shutdown()

    def _publish_kv_events(self) -> None:
        """One batch of what the prefix cache's hash map went through since the last one."""
        if self.kv_events is None:
            return
        events = self.scheduler.kv.take_events()
        if events:
            self.kv_events.publish(events)

    def step(self) -> EngineCoreOutputs | None:
        """One turn of the busy loop: apply the KV transfers that ended, schedule and run the
        model (if any request is unfinished), then hand the KV connector's instructions to its
        worker half and apply what ended meanwhile.

        A pull the schedule starts goes to the worker half before the model runs, so that it
        overlaps the batch's compute; the KV part after the model hands over the leases of
        requests that just finished, so that each exists before its answer leaves. Returns None
        when the step changed nothing (no token computed, no output, no pull or lease ended):
        the loop may then wait for input instead of spinning.

        With async scheduling one step stays in flight: step N+1 is scheduled and queued on the
        device before step N's tokens are read back, so the device never waits for Python.
        """
        outputs: list[EngineCoreOutput] = []
        # A pull that ended since the last step resumes its request in this one.
        kv_ended = self._finish_kv_transfers(outputs)
        num_tokens = 0
        if self.has_unfinished_requests():
            step_outputs, num_tokens = self._step()
            outputs += step_outputs
        # Requests the scheduler ended by itself (a grammar that did not compile).
        outputs += self.scheduler.take_outputs()
        self._start_kv_transfers()  # the leases of requests that just finished
        kv_ended = self._finish_kv_transfers(outputs) or kv_ended
        self._publish_kv_events()
        if not (num_tokens or outputs or kv_ended):
            return None
        return EngineCoreOutputs(outputs, self.scheduler.make_stats(num_tokens))

    def _finish_kv_transfers(self, outputs: list[EngineCoreOutput]) -> bool:
        """Applies the pulls and leases that ended (a pulled request goes back to the front of
        the queue, a failed one ends in `outputs`); True if any did. Called before scheduling,
        so that a pull that ended between steps needs no step of its own to resume, and after
        the model, for what ended during it."""
        worker = self.connector_worker
        if worker is None:
            return False
        kv_output = worker.get_finished()
        if not (kv_output or self.scheduler.kv_refused):
            return False
        outputs += self.scheduler.update_from_kv_output(kv_output)
        return True

    def _start_kv_transfers(self) -> None:
        """Hands the KV connector's worker half what the scheduler decided since the last call:
        the pulls to start and the leases to hold. Called right after scheduling as well, so
        that a pull runs while this step's batch computes rather than once it has."""
        worker = self.connector_worker
        if worker is None:
            return
        meta = self.scheduler.build_connector_meta()
        if meta:
            worker.start_load_kv(meta)

    def _step(self) -> tuple[list[EngineCoreOutput], int]:
        if not self.args.async_scheduling:
            scheduler_output = self.scheduler.schedule()
            self._start_kv_transfers()
            num_tokens = scheduler_output.total_num_scheduled_tokens
            runner_output = self.executor.execute_model(scheduler_output)
            return self.scheduler.update_from_output(scheduler_output, runner_output), num_tokens
        outputs: list[EngineCoreOutput] = []
        # A constrained request's next mask depends on the token in flight: while one runs,
        # the step in flight finishes before the next is scheduled. That batch then loses the
        # overlap (the device waits for the scheduler, as in the synchronous loop); a batch
        # with no constrained request keeps it.
        while self._in_flight and self.scheduler.needs_sampled_tokens():
            oldest, oldest_pending = self._in_flight.popleft()
            outputs += self.scheduler.update_from_output(oldest, oldest_pending.result())
        scheduler_output = self.scheduler.schedule()
        self._start_kv_transfers()
        num_tokens = scheduler_output.total_num_scheduled_tokens
        pending = self.executor.execute_model_async(scheduler_output)
        if num_tokens:
            self._in_flight.append((scheduler_output, pending))
            if len(self._in_flight) < 2:
                return outputs, num_tokens  # keep it in flight while the next step is scheduled
        if not self._in_flight:
            return outputs, num_tokens
        oldest, oldest_pending = self._in_flight.popleft()
        outputs += self.scheduler.update_from_output(oldest, oldest_pending.result())
        return outputs, num_tokens


def _kv_window(mc: ModelConfig) -> int | None:
    """The window past which no layer reads a block, when every layer has one (Mistral): the
    KV cache manager frees blocks that fall behind it. None when any layer is global (Gemma 2)."""
    windows = mc.layer_windows
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available")
    return torch.device(name)
