"""Tests of the KV cache manager: prefix-cache lookups, all-or-nothing allocation, sharing."""

from __future__ import annotations

import pytest

from baton.engine.kv_cache.manager import KVCacheConfig, KVCacheManager
from baton.engine.request import Request
from baton.engine.sampling_params import SamplingParams

BS = 4  # block size of every test here


def _manager(num_blocks: int = 16, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks, block_size=BS, enable_prefix_caching=caching))


def _request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=8))


def _compute(manager: KVCacheManager, request: Request, num_tokens: int | None = None) -> None:
    """Allocates, "runs" and caches the request's remaining tokens (or `num_tokens` of them)."""
    n = num_tokens or request.num_tokens - request.num_computed_tokens
    assert manager.allocate_slots(request, n) is not None
    request.num_computed_tokens += n
    manager.cache_blocks(request)


def _snapshot(manager: KVCacheManager) -> tuple[object, ...]:
    pool = manager.pool
    return (
        {k: list(v) for k, v in manager.req_to_blocks.items()},
        dict(manager._num_cached_blocks),
        [b.ref_cnt for b in pool.blocks],
        [b.block_id for b in pool.free_queue],
        dict(pool.cached_blocks),
    )


def test_config_validation() -> None:
    """num_blocks and block_size below 1 are refused with ValueError."""
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheConfig(0)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheConfig(4, block_size=0)


def test_allocate_slots_rounds_up_to_whole_blocks_and_grows_at_boundaries() -> None:
    """Blocks are allocated for ceil(tokens / block_size); decoding adds one only at a boundary."""
    manager = _manager()
    request = _request("a", list(range(6)))
    new = manager.allocate_slots(request, 6)
    assert new is not None and len(new) == 2
    request.num_computed_tokens = 6
    assert manager.allocate_slots(request, 1) == []  # token 7 still fits in block 1
    request.num_computed_tokens = 7
    assert manager.allocate_slots(request, 1) == []
    request.num_computed_tokens = 8
    grown = manager.allocate_slots(request, 1)
    assert grown is not None and len(grown) == 1
    assert manager.block_ids("a") == [0, 1, 2]
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(request, 0)


def test_get_computed_blocks_hits_only_full_blocks() -> None:
    """A cached 10-token prompt gives 2 full-block hits; its partial third block is never cached."""
    manager = _manager()
    a = _request("a", list(range(10)))
    _compute(manager, a)
    assert len(manager.pool.cached_blocks) == 2
    b = _request("b", [*range(10), 99, 98])
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    assert [blk.block_id for blk in hits] == manager.block_ids("a")[:2]


def test_get_computed_blocks_leaves_the_last_token_to_compute() -> None:
    """A prompt fully cached in whole blocks still computes its last token (whose logits sample)."""
    manager = _manager()
    _compute(manager, _request("a", list(range(12))))
    same = _request("b", list(range(12)))
    hits, num_hit = manager.get_computed_blocks(same)
    assert num_hit == 8 and len(hits) == 2
    shorter = _request("c", list(range(8)))
    assert manager.get_computed_blocks(shorter)[1] == 4
    one_block = _request("d", list(range(4)))
    assert manager.get_computed_blocks(one_block) == ([], 0)


def test_get_computed_blocks_stops_at_the_first_divergent_block() -> None:
    """A prefix match stops at the first block that differs, even if later blocks are equal."""
    manager = _manager()
    _compute(manager, _request("a", list(range(13))))
    b = _request("b", [0, 1, 2, 3, 9, 5, 6, 7, 8, 9, 10, 11, 12])
    assert manager.get_computed_blocks(b)[1] == 4


def test_get_computed_blocks_is_side_effect_free_on_the_pool() -> None:
    """Looking up hits takes no reference, revives nothing and evicts nothing."""
    manager = _manager(num_blocks=4)
    a = _request("a", list(range(9)))
    _compute(manager, a)
    manager.free(a)
    before = _snapshot(manager)
    hits, num_hit = manager.get_computed_blocks(_request("b", list(range(9))))
    assert num_hit == 8
    assert all(blk.ref_cnt == 0 for blk in hits)
    assert _snapshot(manager) == before


def test_caching_disabled_never_hits() -> None:
    """With prefix caching off nothing is cached and lookups return no hits."""
    manager = _manager(caching=False)
    _compute(manager, _request("a", list(range(9))))
    assert manager.pool.cached_blocks == {}
    assert manager.get_computed_blocks(_request("b", list(range(9)))) == ([], 0)


def test_allocate_slots_changes_nothing_when_blocks_do_not_fit() -> None:
    """An allocation that does not fit returns None and leaves every structure untouched."""
    manager = _manager(num_blocks=4)
    a = _request("a", list(range(12)))
    _compute(manager, a)
    b = _request("b", list(range(100, 108)))
    before = _snapshot(manager)
    assert manager.allocate_slots(b, 8) is None
    assert _snapshot(manager) == before
    assert "b" not in manager.req_to_blocks
    assert manager.allocate_slots(b, 4) is not None  # exactly the last free block fits
    assert manager.num_free_blocks == 0


def test_allocate_slots_counts_free_queue_hits_as_no_longer_free() -> None:
    """Hits sitting in the free queue use up free blocks when revived: no over-commit, no change."""
    manager = _manager(num_blocks=4)
    a = _request("a", list(range(9)))
    _compute(manager, a)  # 3 blocks, the first 2 cached
    manager.free(a)
    b = _request("b", [*range(8), *range(50, 58)])  # 16 tokens: 2 hits + 2 new blocks needed
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8 and all(blk.ref_cnt == 0 for blk in hits)
    # 4 free blocks, but 2 of them are the hits: 2 new blocks fit, 3 would not.
    before = _snapshot(manager)
    assert manager.allocate_slots(b, 9, hits) is None
    assert _snapshot(manager) == before
    assert all(blk.ref_cnt == 0 for blk in hits)
    assert manager.get_computed_blocks(b)[1] == 8  # the hits are still cached
    new = manager.allocate_slots(b, 8, hits)
    assert new is not None and len(new) == 2
    assert manager.block_ids("b")[:2] == [blk.block_id for blk in hits]
    assert all(blk.ref_cnt == 1 for blk in hits)
    assert manager.num_free_blocks == 0


def test_allocate_with_hits_allocates_only_the_missing_blocks() -> None:
    """Hits are not allocated again: 2 hit blocks + 1 new token need exactly 1 new block."""
    manager = _manager()
    _compute(manager, _request("a", list(range(9))))
    b = _request("b", list(range(9)))
    hits, num_hit = manager.get_computed_blocks(b)
    new = manager.allocate_slots(b, b.num_tokens - num_hit, hits)
    assert new is not None and len(new) == 1
    assert len(manager.block_ids("b")) == 3


def test_blocks_are_cached_only_by_cache_blocks() -> None:
    """Allocated blocks are not findable until cache_blocks runs after the step computed them."""
    manager = _manager()
    a = _request("a", list(range(9)))
    assert manager.allocate_slots(a, 9) is not None
    a.num_computed_tokens = 9
    b = _request("b", list(range(9)))
    assert manager.get_computed_blocks(b) == ([], 0)
    manager.cache_blocks(a)
    assert manager.get_computed_blocks(b)[1] == 8


def test_blocks_of_a_request_freed_before_its_step_ran_are_never_cached() -> None:
    """A request preempted or aborted right after allocation leaves no hash behind."""
    manager = _manager()
    a = _request("a", list(range(9)))
    assert manager.allocate_slots(a, 9) is not None
    manager.free(a)
    assert manager.pool.cached_blocks == {}
    assert all(blk.block_hash is None for blk in manager.pool.blocks)


def test_cache_blocks_caches_computed_full_blocks_only() -> None:
    """After a 6-token chunk of a 12-token prompt only block 0 is cached; the rest follow later."""
    manager = _manager()
    a = _request("a", list(range(12)))
    _compute(manager, a, 6)
    assert len(manager.pool.cached_blocks) == 1
    _compute(manager, a, 6)
    assert len(manager.pool.cached_blocks) == 3
    assert [blk.block_hash for blk in manager.req_to_blocks["a"]] == a.block_hashes


def test_cache_blocks_covers_output_tokens() -> None:
    """Generated tokens fill blocks too, and those full blocks become prefix-cache hits."""
    manager = _manager()
    a = _request("a", list(range(3)))
    _compute(manager, a)
    for token in (70, 71, 72, 73, 74):
        a.append_output_token(token)
        _compute(manager, a, 1)
    # tokens: 0 1 2 70 | 71 72 73 74 ; the last sampled token (74) is computed too here.
    assert len(manager.pool.cached_blocks) == 2
    b = _request("b", [0, 1, 2, 70, 71, 72, 73, 74, 5])
    assert manager.get_computed_blocks(b)[1] == 8


def test_prefix_cache_counters_count_tokens() -> None:
    """stats.queries adds each lookup's num_tokens and stats.hits the hit tokens."""
    manager = _manager()
    _compute(manager, _request("a", list(range(10))))
    assert (manager.stats.queries, manager.stats.hits) == (0, 0)
    manager.get_computed_blocks(_request("b", list(range(10))))
    manager.get_computed_blocks(_request("c", [*range(4), 42, 43]))
    manager.get_computed_blocks(_request("d", [7, 7, 7]))
    assert manager.stats.queries == 10 + 6 + 3
    assert manager.stats.hits == 8 + 4 + 0


def test_two_requests_with_the_same_prefix_share_blocks() -> None:
    """A second request's hits are the first one's blocks with ref_cnt 2; frees drop one each."""
    manager = _manager(num_blocks=8)
    a = _request("a", list(range(10)))
    _compute(manager, a)
    b = _request("b", [*range(8), 60, 61, 62])
    hits, num_hit = manager.get_computed_blocks(b)
    new = manager.allocate_slots(b, b.num_tokens - num_hit, hits)
    assert new is not None and len(new) == 1
    shared = manager.req_to_blocks["a"][:2]
    assert manager.req_to_blocks["b"][:2] == shared
    assert [blk.ref_cnt for blk in shared] == [2, 2]
    assert manager.num_free_blocks == 8 - 3 - 1
    manager.free(a)
    assert [blk.ref_cnt for blk in shared] == [1, 1]
    assert manager.num_free_blocks == 8 - 2 - 1
    manager.free(b)
    assert [blk.ref_cnt for blk in shared] == [0, 0]
    assert manager.num_free_blocks == 8
    assert manager.get_computed_blocks(_request("c", list(range(10))))[1] == 8


def test_free_puts_tail_blocks_first_in_eviction_order() -> None:
    """free() queues a request's last block first, so its shared prefix is evicted last."""
    manager = _manager(num_blocks=3)
    a = _request("a", list(range(12)))
    _compute(manager, a)
    manager.free(a)
    assert [blk.block_id for blk in manager.pool.free_queue] == [2, 1, 0]
    assert manager.req_to_blocks == {}
    manager.free(a)  # freeing twice through the manager is a no-op, not a double free
    assert manager.num_free_blocks == 3


def test_reset_prefix_cache_through_the_manager() -> None:
    """The manager refuses a reset while a request holds blocks and forgets hits after one."""
    manager = _manager()
    a = _request("a", list(range(9)))
    _compute(manager, a)
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(_request("b", list(range(9)))) == ([], 0)
