"""Gemma 2 end to end: a tiny random Gemma 2 (16-token window on even layers, global odd layers,
score and logit soft-capping, query_pre_attn_scalar unlike head_dim) gives transformers' greedy
tokens with prompts past the window, through every scheduling path and tensor parallelism 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton import LLM, SamplingParams
from baton.engine.models.config import ModelConfig
from baton.engine.ops import cpu_paged_attention
from tests.engine.models.test_sliding_window import _prompts, check_against_transformers
from tests.engine.oracle import assert_greedy_matches

WINDOW = 16
LENGTHS = [5, 16, 33, 47, 80]


@pytest.fixture(scope="module")
def gemma2(tiny_model) -> Path:
    return tiny_model("gemma2", sliding_window=WINDOW)


def test_config(gemma2: Path) -> None:
    """The config carries the alternating windows, the query scale and both soft-caps."""
    mc = ModelConfig.from_pretrained(gemma2)
    assert mc.layer_windows == (WINDOW, None)
    assert mc.attention_scale == 24**-0.5 != mc.head_dim**-0.5
    assert mc.attn_logit_softcapping == 2.0 and mc.final_logit_softcapping == 30.0
    assert mc.tie_word_embeddings


def test_mixed_lengths_match_transformers(gemma2: Path) -> None:
    """Mixed prompt lengths in one batch, past the window, equal transformers; with a global
    layer no block is given back early."""
    llm = LLM(str(gemma2), max_model_len=256)
    assert llm.engine.scheduler.kv.sliding_window is None
    check_against_transformers(gemma2, llm, _prompts(LENGTHS, seed=11))


def test_sdpa_decode_path_matches_transformers(gemma2: Path, monkeypatch) -> None:
    """The torch decode fallback (soft-capped scores, windowed and global layers) is exact."""
    monkeypatch.setattr(cpu_paged_attention, "available", lambda *a: False)
    llm = LLM(str(gemma2), max_model_len=256)
    check_against_transformers(gemma2, llm, _prompts(LENGTHS, seed=12))


def test_chunked_prefill_prefix_hits_and_preemption(gemma2: Path) -> None:
    """Chunked prompts, prefix-cache hits and preemption by recompute all stay exact."""
    llm = LLM(str(gemma2), max_model_len=256, max_num_batched_tokens=16)
    check_against_transformers(gemma2, llm, _prompts([70, 33, 9], seed=13))
    prefix = _prompts([48], seed=14)[0]
    prompts = [prefix + t for t in _prompts([5, 17, 30], seed=15)]
    llm = LLM(str(gemma2), max_model_len=256)
    check_against_transformers(gemma2, llm, prompts[:1])
    check_against_transformers(gemma2, llm, prompts)
    assert llm.engine.scheduler.kv.stats.hits >= 48 * 3
    llm = LLM(str(gemma2), max_model_len=128, num_gpu_blocks_override=12)
    check_against_transformers(
        gemma2, llm, _prompts([40, 45, 50, 20, 30, 60], seed=16), max_tokens=40
    )
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.kv.num_free_blocks == 12


@pytest.mark.slow
def test_tensor_parallel_2_matches_transformers(gemma2: Path) -> None:
    """Two ranks (gloo) give the same greedy tokens as transformers."""
    prompts = _prompts([3, 17, 40], seed=17)
    llm = LLM(str(gemma2), max_model_len=256, tensor_parallel_size=2)
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens = out.outputs[0].token_ids
        assert assert_greedy_matches(gemma2, prompt, tokens) == len(tokens)
