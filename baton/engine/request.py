"""A request inside the engine: its tokens, its status and how far its KV cache has caught up."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence

import msgspec

from baton.engine.protocol import EngineCoreRequest
from baton.engine.sampling_params import SamplingParams
from baton.kv_transfer.params import KVTransferParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # its prompt KV is being pulled from a prefill engine
    # Its grammar is compiling (vLLM's WAITING_FOR_FSM): it sits in `waiting`, skipped by the
    # scheduler (not blocking the queue's head) until the compiler is done with it.
    WAITING_FOR_FSM = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this line is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # Ended by the engine: a failed KV load under policy "fail", a grammar that did not compile.
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence. `num_computed_tokens` catches up with `num_tokens`; there are no phases."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        priority: int = 0,
        group_id: str | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        output_token_ids: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        # Samples of one prompt (n > 1) share a group so the scheduler can let the first one fill
        # the prefix cache before the others look it up.
        self.group_id = group_id
        self.status = (
            RequestStatus.WAITING
            if sampling_params.structured_outputs is None
            else RequestStatus.WAITING_FOR_FSM
        )
        # The KV connector's instructions (do_remote_decode, or do_remote_prefill and where).
        self.kv_transfer_params = kv_transfer_params
        self.kv_load_tried = False  # a remote pull is tried once; a failure recomputes locally
        self.error: str | None = None  # why the engine ended it (FINISHED_ERROR)
        self.stop_reason: int | str | None = None
        # A resumed answer starts with the output another engine produced (`output_token_ids`
        # of the wire): like a preempted request it computes them again, and everything that
        # counts output tokens (max_tokens, min_tokens, penalties, stop checks) counts them.
        self.output_token_ids: list[int] = list(output_token_ids)
        self.num_resumed_tokens = len(self.output_token_ids)
        # prompt + output; the model runner reads tokens [num_computed_tokens, num_tokens).
        self.all_token_ids: list[int] = [*prompt_token_ids, *self.output_token_ids]
        self.num_computed_tokens = 0
        # Tokens scheduled to be sampled whose values are not back yet: at most one in the
        # synchronous loop, two with async scheduling (step N+1 is scheduled before N returns).
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 until then
        self.num_external_tokens = 0  # prompt tokens whose KV a prefill engine handed over
        self.first_scheduled_time: float | None = None
        # Block hashes of the full blocks of all_token_ids, extended as tokens are appended; the
        # first block's chain starts at the salt (`baton.block_hash.salt_root`).
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []

    @classmethod
    def from_core_request(cls, req: EngineCoreRequest, eos_token_ids: tuple[int, ...]) -> Request:
        """The engine's state for a request that came over the wire (or from `LLM`): the
        wire's fields are this constructor's arguments, by name."""
        return cls(eos_token_ids=eos_token_ids, **msgspec.structs.asdict(req))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
