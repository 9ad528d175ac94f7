"""What the offline API returns, named as vLLM names it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    # With `prompt_logprobs`: one entry per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens found in this engine's prefix cache
    num_external_tokens: int = 0  # prompt tokens whose KV a prefill engine handed over
    queue_time: float | None = None  # seconds from arrival to first scheduled
    prefill_time: float | None = None  # seconds from first scheduled to the first token
    # A prefill engine's answer: where the decode engine pulls this prompt's KV from.
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None  # the engine ended it (finish_reason "error"): why
    error_status: int = 503  # the HTTP status of `error`
