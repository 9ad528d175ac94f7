"""The contract between scheduler and worker: plain dataclasses of ints, lists and numpy arrays,
no tensors (they are pickled to every tensor-parallel rank)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from baton.engine.protocol import LogprobsEntry
from baton.engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker has not seen: sent in full once."""

    req_id: str
    prompt_token_ids: list[int]
    # The output it starts with: empty, or a resumed answer's tokens from another engine. The
    # worker keeps prompt + output and appends what it samples; penalties and min_tokens read
    # the output part.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]  # every block the request holds, in order
    num_computed_tokens: int  # tokens already in the cache (prefix-cache hits)


@dataclass
class CachedRequestData:
    """A request the worker already tracks: only what changed since the last step."""

    req_id: str
    new_block_ids: list[int]  # appended to the worker's block table (replacing it if resumed)
    num_computed_tokens: int  # tokens in the cache before this step
    # Back from preemption: its old blocks are gone, `new_block_ids` is the whole table and
    # `all_token_ids` carries prompt + output so far (the worker may have dropped its copy).
    resumed: bool = False
    all_token_ids: list[int] | None = None


@dataclass
class SchedulerOutput:
    """What to run in one step."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> tokens to compute this step; dict order is the batch order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests finished (or preempted) since the last step: the worker drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured outputs (vLLM's `structured_output_request_ids` + `grammar_bitmask`): the
    # constrained requests that sample this step, and their rows of the grammar's token mask,
    # int32 [len(ids), ceil(vocab / 32)], bit t of row i = token t allowed for ids[i]. The runner
    # maps the rows onto its sample rows; a sampling request not listed is unconstrained. None
    # when nothing sampled this step is constrained.
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None


@dataclass
class ModelRunnerOutput:
    """What one step produced. Requests mid-prompt (a partial chunk) sample nothing."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, LogprobsEntry] = field(default_factory=dict)
    # Requests whose prompt finished this step and asked for prompt_logprobs: one entry per
    # prompt position 1.. (the first entry's first token is the prompt's second token); sent
    # once, on the step that samples the request's first token.
    prompt_logprobs: dict[str, list[LogprobsEntry]] = field(default_factory=dict)
