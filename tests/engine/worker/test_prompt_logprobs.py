"""Unit tests of prompt-logprob bookkeeping: chunk coverage, truncation on resume, and the KV
cache manager's refusal of prefix-cache hits for requests that ask for them."""

from __future__ import annotations

import torch

from baton.engine.kv_cache.manager import KVCacheConfig, KVCacheManager
from baton.engine.request import Request
from baton.engine.sampling_params import SamplingParams
from baton.engine.worker.model_runner import _covers_prompt, _truncate_chunks


def _chunk(first: int, n: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk predicting positions first .. first + n - 1; ids hold the position itself."""
    ids = torch.arange(first, first + n).unsqueeze(1)
    return first, ids, ids.float(), torch.ones(n, dtype=torch.long)


def test_coverage_needs_positions_one_to_n_minus_one_exactly() -> None:
    assert _covers_prompt([_chunk(1, 15), _chunk(16, 16), _chunk(32, 8)], 40)
    assert _covers_prompt([_chunk(16, 16), _chunk(1, 15)], 32)  # any order
    assert _covers_prompt([], 1)  # a one-token prompt predicts nothing
    assert not _covers_prompt([], 5)
    assert not _covers_prompt([_chunk(17, 8)], 25)  # the head came from a cache hit
    assert not _covers_prompt([_chunk(1, 8), _chunk(8, 4)], 12)  # overlap
    assert not _covers_prompt([_chunk(1, 8), _chunk(10, 4)], 14)  # gap


def test_truncate_keeps_what_a_resumed_request_does_not_recompute() -> None:
    """Resumed at num_computed c, hidden states c.. are recomputed: positions c + 1.. go."""
    chunks = [_chunk(1, 15), _chunk(16, 16), _chunk(32, 8)]
    kept = _truncate_chunks(chunks, 20)
    assert [(first, len(ids)) for first, ids, _, _ in kept] == [(1, 15), (16, 5)]
    assert kept[1][1][:, 0].tolist() == [16, 17, 18, 19, 20]
    assert _truncate_chunks(chunks, 0) == []
    # and then recomputing from 20 makes the coverage whole again
    assert _covers_prompt([*kept, _chunk(21, 19)], 40)


def test_prompt_logprobs_requests_get_no_prefix_cache_hits() -> None:
    """vLLM skips the prefix cache for prompt_logprobs: no hits and no query counted."""
    manager = KVCacheManager(KVCacheConfig(16, block_size=4))
    prompt = list(range(13))
    first = Request("a", prompt, SamplingParams(max_tokens=4))
    assert manager.allocate_slots(first, 13) is not None
    first.num_computed_tokens = 13
    manager.cache_blocks(first)
    plain = Request("b", prompt, SamplingParams(max_tokens=4))
    assert manager.get_computed_blocks(plain)[1] == 12
    queries = manager.stats.queries
    asks = Request("c", prompt, SamplingParams(max_tokens=4, prompt_logprobs=0))
    assert manager.get_computed_blocks(asks) == ([], 0)
    assert manager.stats.queries == queries
