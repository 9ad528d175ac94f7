"""Checks a prompt and splits a request into its samples; shared by `LLM` and `AsyncLLM`."""

from __future__ import annotations

from dataclasses import replace

from baton.engine.sampling_params import SamplingParams


def check_prompt_token_ids(ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """Raises ValueError, naming the limit and the length, for a prompt the engine cannot take."""
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) > max_model_len:
        raise ValueError(
            f"the prompt is {len(ids)} tokens, longer than max_model_len {max_model_len}"
        )
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"the prompt has token ids outside [0, {vocab_size}): {bad[:5]}")


def child_requests(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The engine requests of one prompt: itself when n == 1, else n samples `{i}_{id}`.

    With a seed, sample i draws from seed + i: distinct but reproducible samples.
    """
    if params.n == 1:
        return [(request_id, params)]
    children = []
    for i in range(params.n):
        child = params if params.seed is None else replace(params, seed=params.seed + i)
        children.append((f"{i}_{request_id}", child))
    return children
