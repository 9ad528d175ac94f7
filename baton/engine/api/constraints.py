"""What a request's constraints need from the model at the API edge: bad words as token ids,
token ids checked against the vocabulary, and structured outputs checked by the grammar compiler
before a request reaches the core (a bad schema is a 400 here, never an engine error later).

The checks follow vLLM's processor and `SamplingParams.update_from_tokenizer`, message for
message where the message is useful to a client. Everything here is torch-free: the grammar
compiler is llguidance's, which the API process may load.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Protocol

from baton.engine.sampling_params import SamplingParams, StructuredOutputsParams
from baton.errors import APIError

Encode = Callable[[str], list[int]]


class ConstraintValidator(Protocol):
    """The grammar compiler's edge check (`GrammarCompiler.validate`): raises ValueError (its
    `GrammarError`) naming the problem."""

    def validate(self, params: StructuredOutputsParams) -> None: ...


def bad_words_token_ids(words: Sequence[str], encode: Encode) -> list[list[int]]:
    """vLLM's bad-word tokenization: each word as it starts a text and, when that differs, as
    it follows a space (a word-start token of its own), so that the word is forbidden both at
    the start of the output and inside it."""
    out: list[list[int]] = []
    for word in words:
        bare = encode(word.lstrip())
        if not bare:
            raise APIError(400, f"bad_words: {word!r} has no tokens", "bad_words")
        out.append(bare)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids the request names must be in the model's vocabulary (vLLM's processor checks
    the same three fields, each a 400 naming its field)."""
    if params.logit_bias:
        bad = sorted(t for t in params.logit_bias if t >= vocab_size)
        if bad:
            raise APIError(
                400,
                f"token_id(s) {bad[:10]} in logit_bias contain out-of-vocab token ids. "
                f"Vocabulary size: {vocab_size}",
                "logit_bias",
            )
    if params.allowed_token_ids is not None:
        bad = sorted(t for t in params.allowed_token_ids if t >= vocab_size)
        if bad:
            raise APIError(
                400,
                f"allowed_token_ids contains out-of-vocab token ids {bad[:10]}. "
                f"Vocabulary size: {vocab_size}",
                "allowed_token_ids",
            )
    bad = sorted({t for word in params.bad_words_token_ids for t in word if t >= vocab_size})
    if bad:
        raise APIError(
            400,
            f"The model vocabulary size is {vocab_size}, but the following tokens were "
            f"specified as bad: {bad[:10]}. All token id values should be integers satisfying: "
            f"0 <= token_id < {vocab_size}.",
            "bad_words",
        )


def validate_constraint(
    validator: ConstraintValidator, params: StructuredOutputsParams, param: str
) -> None:
    """The grammar compiler's verdict on `params` as a 400 naming `param` (the request field
    the constraint came from)."""
    try:
        validator.validate(params)
    except ValueError as e:
        raise APIError(400, _named(str(e), param), param) from None


# The compiler names the params' field (`structured_outputs.json: ...`); the client wrote another.
_KIND_PREFIX = re.compile(
    r"^structured_outputs\.(json_object|json|regex|choice|grammar|structural_tag)"
)


def _named(message: str, param: str) -> str:
    if param == "structured_outputs":
        return message
    if _KIND_PREFIX.match(message):
        return _KIND_PREFIX.sub(param, message, count=1)
    return f"{param}: {message}"
