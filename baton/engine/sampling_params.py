"""Per-request sampling parameters, validated at construction (vLLM's `SamplingParams`)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
# The kinds of constraint a `StructuredOutputsParams` may set, exactly one at a time.
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on what a request may generate (vLLM's `StructuredOutputsParams`): exactly
    one of the kinds is set. The API edge builds it from `response_format`, `structured_outputs`,
    the older `guided_*` fields or a forced tool choice; the engine compiles it to a grammar and
    masks every token it samples with it. Frozen and plain, so it keys the grammar cache."""

    json: str | None = None  # a JSON schema, as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # exactly one of these strings
    grammar: str | None = None  # a Lark grammar, or GBNF (which the compiler converts)
    structural_tag: str | None = None  # vLLM's structural tag, as JSON text
    # The constraint starts after the output has produced these token ids (the end of the
    # reasoning, e.g. `</think>`); None: from the first output token.
    after_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        num_kinds = sum(getattr(self, k) not in (None, False) for k in STRUCTURED_OUTPUT_KINDS)
        if num_kinds != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; "
                f"got {num_kinds}"
            )
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        if self.after_token_ids is not None:
            object.__setattr__(self, "after_token_ids", tuple(self.after_token_ids))


@dataclass
class SamplingParams:
    """How one prompt is continued. Invalid values raise `ValueError` naming the field and range."""

    n: int = 1
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-n logprobs per generated token, plus the sampled one
    # top-n logprobs of every prompt position after the first, plus the prompt's own token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> added to its logit before any other processing (OpenAI's -100..100)
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled (vLLM's `allowed_token_ids`).
    allowed_token_ids: list[int] | None = None
    # vLLM's `bad_words`, tokenized at the edge: a sequence's last token is forbidden whenever the
    # output ends with the tokens before it (a one-token word is always forbidden).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        _check_int("n", self.n, lo=1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        _check_float("temperature", self.temperature, lo=0.0, hi=2.0)  # vLLM's and OpenAI's
        if self.n > 1 and self.greedy:  # n identical answers: vLLM's error, its words
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")
        _check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=0)
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, hi=None, lo_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(2**63), hi=2**63 - 1)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=20)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=20)
        if self.logit_bias is not None:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            for t, b in self.logit_bias.items():
                _check_int("logit_bias key", t, lo=0)
                _check_float("logit_bias value", b, lo=-100.0, hi=100.0)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids[]", t, lo=0)
        self.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids]
        for word in self.bad_words_token_ids:
            if not word:
                raise ValueError("bad_words must not contain an empty word")
            for t in word:
                _check_int("bad_words token id", t, lo=0)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[]", t, lo=0)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def resumed_seed(seed: int, position: int) -> int:
    """The seed of a seeded request that an engine resumes at output position `position` (the
    answer's first `position` tokens came from another engine, `resume_token_ids`).

    The engine that began the answer drew `position` times from a generator seeded with
    `seed`; those draws cannot be replayed elsewhere (they depend on the batch and the device),
    so the continuation samples from a seed of its own: the signed 64-bit integer of
    blake2b(f"{seed}:{position}", 8 bytes). The same request resumed at the same point samples
    the same continuation on any engine. Position 0 keeps `seed`: nothing was drawn yet.
    """
    if position == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_float(
    name: str, value: object, lo: float, hi: float | None, lo_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    too_low = value <= lo if lo_open else value < lo
    if too_low or (hi is not None and value > hi) or math.isinf(value):
        left = "(" if lo_open else "["
        right = f"{hi}]" if hi is not None else "inf)"
        raise ValueError(f"{name} must be in {left}{lo}, {right}, got {value}")
