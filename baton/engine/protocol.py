"""The wire between the API server process and the EngineCore process: msgspec structs that both
sides build and read directly (the scheduler makes `EngineCoreOutput`s, the core sends them
as they are). Torch-free: it imports only the engine's plain configuration records.

Handshake on its own socket: the core says `Hello`, the server answers `CoreConfig`, the core
loads the model, sizes the KV cache and answers `Ready` (or `Failed`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from baton.engine.config import EngineArgs
from baton.engine.sampling_params import SamplingParams
from baton.kv_transfer.base import TransferResult
from baton.kv_transfer.fingerprint import Fingerprint
from baton.kv_transfer.params import KVTransferParams

# ---- handshake -----------------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello"):
    pid: int


class CoreConfig(msgspec.Struct, tag="config"):
    input_address: str  # the core PULLs requests from here
    output_address: str  # the core PUSHes outputs to here
    engine_args: EngineArgs


class Ready(msgspec.Struct, tag="ready"):
    """What the server needs to know of the engine; the core is the one that read the model."""

    num_blocks: int
    max_model_len: int
    model_path: str  # the folder in use (the built-in model's, when none was named)
    vocab_size: int
    eos_token_ids: list[int]  # where a grammar lets the answer end
    kv_transport: str | None = None  # the KV transport in use (None: no connector)
    kv_ports: list[int] | None = None  # one per tensor-parallel rank
    fingerprint: Fingerprint | None = None  # what a hand-off partner must equal


class Failed(msgspec.Struct, tag="failed"):
    error: str


Handshake = Hello | CoreConfig | Ready | Failed

# ---- server -> core ------------------------------------------------------------------------


class EngineCoreRequest(msgspec.Struct, tag="add"):
    """One sequence to generate for (a prompt with n > 1 is n of them, in one group)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    # Samples of one prompt (n > 1) share a group so the scheduler can let the first one fill
    # the prefix cache before the others look it up.
    group_id: str | None = None
    kv_transfer_params: KVTransferParams | None = None
    # A resumed answer (the API's `resume_token_ids`): the output tokens another engine already
    # produced. The request starts with them as its output, as a preempted request is
    # recomputed: everything that counts output tokens counts them, and the first step computes
    # prompt + output and samples the token after them. Empty: a new answer.
    output_token_ids: list[int] = []
    # vLLM's `cache_salt`: starts the chain of the prompt's block hashes, so that requests with
    # different salts (tenants) never share prefix-cache blocks. None: unsalted.
    cache_salt: str | None = None


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility"):
    call_id: int
    method: str  # "reset_prefix_cache" or "shutdown"


CoreInput = EngineCoreRequest | AbortRequests | UtilityCall

# ---- core -> server ------------------------------------------------------------------------


class LogprobsEntry(msgspec.Struct, array_like=True):
    """Logprobs of one sampled position: the sampled token first, then the top ones."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # 1 = the most likely token


class EngineCoreOutput(msgspec.Struct, array_like=True):
    """What the core reports for one request after one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsEntry] | None = None
    # With `prompt_logprobs`, on the request's first output: prompt positions 1.. in order, each
    # entry's first token the prompt's own token at that position.
    prompt_logprobs: list[LogprobsEntry] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_cached_tokens: int = 0
    num_external_tokens: int = 0  # prompt tokens whose KV was pulled from a prefill engine
    queue_time: float | None = None  # seconds from arrival to first scheduled, on the first output
    prefill_time: float | None = None  # seconds from first scheduled to the first token, with it
    # On the last output of a prefill request whose KV is leased to a decode engine.
    kv_transfer_params: KVTransferParams | None = None
    error: str | None = None  # with finish_reason "error": the message for the client
    # The HTTP status the error answers with: 503 for the engine's side (a failed KV load), 400
    # for what the request itself asked (a grammar too costly to follow, constraints that leave
    # no token).
    error_status: int = 503

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineStats(msgspec.Struct):
    """The engine's state after a step; the server's gauges and backpressure read it."""

    num_running: int = 0
    num_waiting: int = 0  # requests waiting for their remote KV included, as vLLM counts them
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # cumulative, tokens
    prefix_cache_hits: int = 0
    num_preemptions: int = 0  # cumulative
    step_tokens: int = 0  # tokens computed in the step that produced this message
    kv_transfers: list[TransferResult] = []  # pulls that ended since the last message
    kv_blocks_leased: int = 0
    kv_leases_expired: int = 0  # cumulative


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    stats: EngineStats
    utility_results: list[UtilityResult] = []


encoder = msgspec.msgpack.Encoder()
handshake_decoder = msgspec.msgpack.Decoder(Handshake)
input_decoder = msgspec.msgpack.Decoder(CoreInput)
output_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
