"""Sliding-window attention end to end: a tiny Mistral with a 16-token window gives transformers'
greedy tokens with prompts and outputs past the window, on every attention path, and the KV
cache holds only the window's blocks; the per-layer windows are read as transformers reads them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from baton import LLM, SamplingParams
from baton.engine.models.config import ModelConfig
from baton.engine.ops import cpu_paged_attention
from tests.engine.oracle import assert_greedy_matches

WINDOW = 16
# Under the window, on it, and two to five windows long: a wrong window shows in the last three.
LENGTHS = [5, 16, 33, 47, 80]


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def check_against_transformers(path: Path, llm: LLM, prompts: list[list[int]], **kw: int) -> None:
    """Every prompt's greedy tokens equal transformers' (up to a near-tie, rarely)."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(**kw))
    compared = sum(
        assert_greedy_matches(path, p, o.outputs[0].token_ids)
        for p, o in zip(prompts, outputs, strict=True)
    )
    assert compared >= 0.8 * sum(len(o.outputs[0].token_ids) for o in outputs)


@pytest.fixture(scope="module")
def mistral(tiny_model) -> Path:
    return tiny_model("mistral", sliding_window=WINDOW)


def test_window_read_per_layer(tmp_path: Path, mistral: Path) -> None:
    """Mistral slides on every layer; Qwen2 only with use_sliding_window and from
    max_window_layers on; Gemma 2 as its layer_types say, else every other layer."""
    assert ModelConfig.from_pretrained(mistral).layer_windows == (WINDOW, WINDOW)
    cfg = json.loads((mistral / "config.json").read_text())

    def windows(**changes: object) -> tuple[int | None, ...]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **changes}))
        return ModelConfig.from_pretrained(tmp_path).layer_windows

    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4, "sliding_window": 8}
    assert windows(**qwen2) == (None,) * 4
    assert windows(**qwen2, use_sliding_window=True, max_window_layers=1) == (None, 8, 8, 8)
    gemma = {"architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 3, "sliding_window": 8}
    assert windows(**gemma) == (8, None, 8)
    types = ["full_attention", "sliding_attention", "full_attention"]
    assert windows(**gemma, layer_types=types) == (None, 8, None)
    assert windows(sliding_window=None) == (None, None)


def test_mixed_lengths_match_transformers(mistral: Path) -> None:
    """A batch of prompts shorter and longer than the window, decoding past it, equals
    transformers token for token (C decode kernel, SDPA prefill with a window mask); the
    max_model_len is not capped to the window any more."""
    llm = LLM(str(mistral), max_model_len=256)
    assert llm.engine.max_model_len == 256
    check_against_transformers(mistral, llm, _prompts(LENGTHS, seed=1))


def test_phi3_windows_every_layer_as_transformers_does(tiny_model) -> None:
    """Phi-3's window (its fused q/k/v and gate/up split at load) on every layer, prompts
    shorter and longer than it, against transformers' Phi3 model."""
    path = tiny_model("phi3", sliding_window=WINDOW)
    assert ModelConfig.from_pretrained(path).layer_windows == (WINDOW, WINDOW)
    check_against_transformers(path, LLM(str(path), max_model_len=256), _prompts(LENGTHS, seed=3))


def test_sdpa_decode_path_matches_transformers(mistral: Path, monkeypatch) -> None:
    """The SDPA decode fallback (no C kernel) honours the window too."""
    monkeypatch.setattr(cpu_paged_attention, "available", lambda *a: False)
    llm = LLM(str(mistral), max_model_len=256)
    check_against_transformers(mistral, llm, _prompts(LENGTHS, seed=2))


def test_chunked_prefill_and_prefix_hits_match_transformers(mistral: Path) -> None:
    """Prompts chunked by a small token budget (chunks that start past the window) and prompts
    that hit the prefix cache (hits behind the window are not taken) stay exact."""
    llm = LLM(str(mistral), max_model_len=256, max_num_batched_tokens=16)
    check_against_transformers(mistral, llm, _prompts([70, 33, 9], seed=3))
    prefix = _prompts([48], seed=4)[0]
    prompts = [prefix + t for t in _prompts([5, 17, 30], seed=5)]
    llm = LLM(str(mistral), max_model_len=256)
    check_against_transformers(mistral, llm, prompts[:1])
    check_against_transformers(mistral, llm, prompts)
    assert llm.engine.scheduler.kv.stats.hits >= 48 * 3


def test_preemption_matches_transformers(tiny_model) -> None:
    """Few blocks force preemption by recompute; outputs stay exact and every block returns.
    (A 48-token window: with 16, requests give blocks back as fast as they take them.)"""
    path = tiny_model("mistral", sliding_window=48)
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=8)
    prompts = _prompts([40, 45, 50, 20, 30, 60], seed=6)
    check_against_transformers(path, llm, prompts, max_tokens=40)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.kv.num_free_blocks == 8


def test_long_request_holds_only_its_window(mistral: Path) -> None:
    """A 100-token prompt plus 60 tokens runs in a cache of 6 blocks of 16: it never holds more
    than the window's blocks plus the one being filled, where full attention would need 10."""
    llm = LLM(str(mistral), max_model_len=256, num_gpu_blocks_override=16)
    kv = llm.engine.scheduler.kv
    held: list[int] = []
    original = kv.allocate_slots

    def spy(request, *args, **kwargs):  # type: ignore[no-untyped-def]
        result = original(request, *args, **kwargs)
        held.append(kv.num_held_blocks(request.request_id))
        return result

    kv.allocate_slots = spy  # type: ignore[method-assign]
    prompt = _prompts([100], seed=7)[0]
    out = llm.generate([{"prompt_token_ids": prompt}], _greedy(60))
    assert assert_greedy_matches(mistral, prompt, out[0].outputs[0].token_ids) > 0
    assert max(held[1:]) <= -(-WINDOW // 16) + 1 + 1  # after the prompt: window + filling
    assert held[0] == -(-100 // 16)
