"""Tensor parallelism end to end: `LLM(..., tensor_parallel_size=2)` on CPU with gloo gives the
same greedy tokens as one process and as transformers, for every supported architecture."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from baton import LLM, SamplingParams
from tests.engine.oracle import assert_greedy_matches

pytestmark = pytest.mark.slow  # each engine starts two worker processes: seconds

LENGTHS = [3, 17, 40]  # under a block, just past one, several


def _prompts(seed: int = 0) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)]} for n in LENGTHS]


def _generate(path: Path, prompts: list[dict[str, list[int]]], **args: object) -> list[list[int]]:
    llm = LLM(str(path), max_model_len=256, **args)  # type: ignore[arg-type]
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("arch", "model_args"),
    [
        pytest.param("llama", {}, id="llama"),
        pytest.param("qwen2", {}, id="qwen2"),  # q/k/v biases, sharded with their weights
        pytest.param("qwen3", {}, id="qwen3"),  # per-head q/k norms
        # Mistral runs Llama's code path (no biases, no q/k norms): its tp1 answers are checked
        # against transformers in test_llm, its tp2 ones in make test-long.
        pytest.param("mistral", {}, id="mistral", marks=pytest.mark.long),
        pytest.param("llama", {"num_key_value_heads": 1}, id="llama-1-kv-head"),  # replicated
        # q/k/v/o and gate/up/down biases: o_proj's and down_proj's added once, on rank 0
        pytest.param("llama", {"biases": True}, id="llama-biases"),
        pytest.param("phi3", {}, id="phi3"),  # q/k/v and gate/up stored fused, split per rank
    ],
)
def test_tp2_greedy_equals_tp1_and_transformers(
    tiny_model, arch: str, model_args: dict[str, object]
) -> None:
    """Greedy tokens with tensor_parallel_size 2 equal tensor_parallel_size 1 and transformers,
    including a model with one KV head (replicated on both ranks) and one with every bias."""
    path = tiny_model(arch, **model_args)
    prompts = _prompts()
    tp1 = _generate(path, prompts)
    tp2 = _generate(path, prompts, tensor_parallel_size=2)
    assert tp2 == tp1
    for prompt, tokens in zip(prompts, tp2, strict=True):
        assert assert_greedy_matches(path, prompt["prompt_token_ids"], tokens) == len(tokens)


def test_tp2_with_async_scheduling_and_chunked_prefill(tiny_model) -> None:
    """Async scheduling (two steps in flight to the workers) and prompts chunked over several
    steps give the same tokens under tensor parallelism."""
    path = tiny_model("qwen2")
    prompts = _prompts(seed=1)
    expected = _generate(path, prompts)
    got = _generate(
        path, prompts, tensor_parallel_size=2, async_scheduling=True, max_num_batched_tokens=16
    )
    assert got == expected
