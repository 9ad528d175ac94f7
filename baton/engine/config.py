"""Engine arguments under vLLM's names, validated once, and what follows from them.

Torch-free: the API server process builds these and sends them to the EngineCore.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from baton.kv_events import KVEventsConfig
from baton.kv_transfer.base import KVTransferConfig

_DEVICES = ("auto", "cpu", "cuda")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(model: str) -> bool:
    """Whether `--model` reads as a Hugging Face repo id (`org/name`) rather than a path (the
    engine resolves it: `baton.engine.models.source`; the API server names the model by it)."""
    return bool(_REPO_ID.fullmatch(model)) and ".." not in model and not model.endswith(".gguf")


SCHEDULING_POLICIES = ("fcfs", "priority")
ATTENTION_BACKENDS = ("torch", "triton")  # Baton's Triton kernels on CUDA; C/torch elsewhere
EXECUTOR_BACKENDS = ("uni", "mp")  # in this process; one worker process per rank


STRUCTURED_OUTPUT_BACKENDS = ("auto", "guidance")  # llguidance; "auto" names it too


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's `--structured-outputs-config`: how the engine compiles constraints.

    Baton's one departure from vLLM's defaults: JSON has no free whitespace unless asked for
    (`disable_any_whitespace: false`). A grammar that allows whitespace between every token lets
    a model pad forever where its likeliest token is a space or newline, and the answer is then
    cut at max_tokens, invalid; compact JSON is also what OpenAI's structured outputs return."""

    backend: str = "auto"
    disable_any_whitespace: bool = True
    # Objects in a JSON schema that say nothing of other properties allow none.
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(
                f"structured_outputs_config.backend must be one of "
                f"{STRUCTURED_OUTPUT_BACKENDS}, got {self.backend!r}"
            )


@dataclass(frozen=True)
class EngineArgs:
    """Everything that shapes one engine. `None` means: derive it from the model and device."""

    # A Hugging Face folder, a GGUF file, or a hub repo id (org/name); None: the default model
    model: str | None = None
    revision: str | None = None  # of a hub repo id (branch, tag or commit; default main)
    download_dir: str | None = None  # the hub cache for repo ids (default: huggingface_hub's)
    tokenizer: str | None = None  # defaults to the model folder
    chat_template: str | None = None  # replaces the tokenizer's (vLLM's --chat-template)
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # defaults to max(8192, max_model_len)
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None  # default: 4 GiB on CPU, see gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    scheduling_policy: str = "fcfs"
    device: str = "auto"
    attention_backend: str | None = None  # default: triton on CUDA, torch elsewhere
    async_scheduling: bool = False  # schedule step N+1 while step N runs on the device
    # Disaggregated serving: role, transport and leases. None: no KV connector (role "both").
    kv_transfer: KVTransferConfig | None = None
    tensor_parallel_size: int = 1  # worker processes, one per rank (one per GPU)
    # "uni": the model in the EngineCore's process; "mp": worker processes. None: uni for
    # tensor_parallel_size 1, mp above.
    distributed_executor_backend: str | None = None
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    # vLLM's `--kv-events-config`: publish the prefix cache's changes over ZMQ. None: off.
    kv_events_config: KVEventsConfig | None = None

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "max_num_seqs",
            "tensor_parallel_size",
            "max_model_len",
            "max_num_batched_tokens",
            "num_gpu_blocks_override",
            "kv_cache_memory_bytes",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        for name, allowed in (
            ("scheduling_policy", SCHEDULING_POLICIES),
            ("device", _DEVICES),
            ("distributed_executor_backend", EXECUTOR_BACKENDS),
            ("attention_backend", ATTENTION_BACKENDS),
        ):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(
                "distributed_executor_backend 'uni' runs one process: tensor_parallel_size "
                f"{self.tensor_parallel_size} needs 'mp'"
            )
        events = self.kv_events_config
        if events is not None and events.enabled:
            for endpoint in (events.endpoint, events.replay_endpoint):
                if endpoint is not None and endpoint.startswith("tcp://"):
                    _check_fixed_port(endpoint)
        kvt = self.kv_transfer
        if kvt is not None and kvt.port and kvt.port + self.tensor_parallel_size > 65536:
            raise ValueError(
                f"kv port {kvt.port} leaves no room for {self.tensor_parallel_size} ranks "
                f"(rank r serves on kv port + r)"
            )

    @property
    def kv_events_enabled(self) -> bool:
        return self.kv_events_config is not None and self.kv_events_config.enabled

    @property
    def executor_backend(self) -> str:
        """The executor in effect: the one asked for, else by tensor_parallel_size."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.tensor_parallel_size > 1 else "uni"


def _check_fixed_port(endpoint: str) -> None:
    """A KV events endpoint needs a port that subscribers know beforehand: the router reads it
    from /health and connects to it, so a port the system picks (0 or `*`) is refused."""
    port = endpoint.rpartition(":")[2]
    if not port.isdigit() or int(port) == 0:
        raise ValueError(
            f"kv-events-config: {endpoint!r} needs a fixed port (port 0 or '*' is not "
            "supported: subscribers must know the port)"
        )
