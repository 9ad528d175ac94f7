"""SamplingParams validation: bad values raise ValueError naming the field and range."""

from __future__ import annotations

import pytest

from baton import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be >= 1"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens must be <= max_tokens"),
        ({"temperature": -0.5}, r"temperature must be in \[0.0, 2.0\]"),
        ({"temperature": 2.5}, r"temperature must be in \[0.0, 2.0\]"),  # vLLM's bound
        ({"n": 2, "temperature": 0.0}, "n must be 1 when using greedy sampling, got 2"),
        ({"top_p": 0.0}, r"top_p must be in \(0.0, 1.0\]"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k must be >= 0"),
        ({"min_p": 2.0}, r"min_p must be in \[0.0, 1.0\]"),
        ({"presence_penalty": 3.0}, r"presence_penalty must be in \[-2.0, 2.0\]"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
        ({"stop": [""]}, "stop must be a list of non-empty strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"temperature": float("nan")}, "temperature must be a number"),
        ({"n": 1.5}, "n must be an integer"),
        ({"seed": True}, "seed must be an integer"),
    ],
)
def test_invalid_values_raise(kwargs: dict, message: str) -> None:
    """Each invalid value is rejected with a message naming the field and its allowed range."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation() -> None:
    """A single stop string becomes a list, top_k=-1 means disabled, temperature 0 is greedy."""
    p = SamplingParams(stop="###", top_k=-1, temperature=0.0)
    assert p.stop == ["###"] and p.top_k == 0 and p.greedy
    assert not SamplingParams().greedy
