"""The wire protocol between the API server process and the EngineCore process (msgspec).

Defined once, used by both sides. Token ids travel as packed int32 bytes, not lists of ints.
Handshake on its own socket: the core says `Hello`, the server answers `CoreConfig`, the core
loads the model, sizes the KV cache and answers `Ready` (or `Failed`).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from baton.engine.config import EngineArgs
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler.output import EngineCoreOutput, LogprobsEntry


def pack_ids(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype=np.int32).tobytes()


def unpack_ids(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype=np.int32).tolist()


# ---- handshake -----------------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello"):
    pid: int


class CoreConfig(msgspec.Struct, tag="config"):
    input_address: str  # the core PULLs requests from here
    output_address: str  # the core PUSHes outputs to here
    engine_args: EngineArgs


class Ready(msgspec.Struct, tag="ready"):
    num_blocks: int
    max_model_len: int
    model_path: str
    kv_transport: str | None = None  # the KV transport in use (None: no connector)
    kv_ports: list[int] | None = None  # one per tensor-parallel rank


class Failed(msgspec.Struct, tag="failed"):
    error: str


Handshake = Hello | CoreConfig | Ready | Failed

# ---- server -> core ------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: bytes  # packed int32
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    priority: int = 0
    group_id: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility"):
    call_id: int
    method: str  # one of UTILITY_METHODS
    args: list[Any] = []


UTILITY_METHODS = ("reset_prefix_cache", "get_load", "shutdown")

CoreInput = AddRequest | AbortRequests | UtilityCall

# ---- core -> server ------------------------------------------------------------------------


class EngineStats(msgspec.Struct):
    """The core's state after a step; the server's gauges and backpressure read it."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # cumulative, tokens
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    step_tokens: int = 0  # tokens computed in the step that produced this message
    # KV transfers that ended since the last message: (bytes, seconds, failure reason or "").
    kv_transfers: list[tuple[int, float, str]] = []
    kv_blocks_leased: int = 0
    kv_leases_expired: int = 0  # cumulative


class OutputWire(msgspec.Struct, array_like=True):
    request_id: str
    new_token_ids: bytes  # packed int32
    new_logprobs: list[LogprobsEntry] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    queue_time: float | None
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


class CoreOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[OutputWire]
    stats: EngineStats
    utility_results: list[UtilityResult] = []


def to_wire(out: EngineCoreOutput) -> OutputWire:
    return OutputWire(
        out.request_id,
        pack_ids(out.new_token_ids),
        out.new_logprobs,
        out.finish_reason,
        out.stop_reason,
        out.num_cached_tokens,
        out.queue_time,
        out.kv_transfer_params,
        out.error,
    )


def from_wire(out: OutputWire) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id=out.request_id,
        new_token_ids=unpack_ids(out.new_token_ids),
        new_logprobs=out.new_logprobs,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        num_cached_tokens=out.num_cached_tokens,
        queue_time=out.queue_time,
        kv_transfer_params=out.kv_transfer_params,
        error=out.error,
    )


encoder = msgspec.msgpack.Encoder()
handshake_decoder = msgspec.msgpack.Decoder(Handshake)
input_decoder = msgspec.msgpack.Decoder(CoreInput)
output_decoder = msgspec.msgpack.Decoder(CoreOutputs)
