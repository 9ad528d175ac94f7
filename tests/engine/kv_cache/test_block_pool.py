"""Tests of the block pool: the intrusive free queue, ref counts, LRU eviction, the hash map."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from baton.block_hash import hash_block_tokens
from baton.engine.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


class _RecordingBlock(KVCacheBlock):
    """A block that records every write to its free-queue links (the base class has __slots__)."""

    writes: list[int]

    def __setattr__(self, name: str, value: object) -> None:
        if name in ("prev_free", "next_free") and hasattr(self, "writes"):
            self.writes.append(self.block_id)
        object.__setattr__(self, name, value)


def _ids(blocks: Iterable[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def _hash(i: int) -> bytes:
    return hash_block_tokens(None, [i])


def test_free_queue_starts_in_block_id_order() -> None:
    """A fresh queue holds every block, first to last, and counts them."""
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert _ids(queue) == [0, 1, 2, 3, 4]
    assert queue.num_free_blocks == 5


def test_free_queue_remove_from_middle_touches_only_neighbours() -> None:
    """Removing a block from the middle rewires only it and its two neighbours: O(1), no scan."""
    writes: list[int] = []
    blocks = [_RecordingBlock(i) for i in range(1000)]
    queue = FreeKVCacheBlockQueue(blocks)
    for block in blocks:
        block.writes = writes
    queue.remove(blocks[500])
    assert set(writes) == {499, 500, 501}
    assert len(writes) <= 4
    assert queue.num_free_blocks == 999
    assert 500 not in _ids(queue)
    assert blocks[499].next_free is blocks[501]
    assert blocks[501].prev_free is blocks[499]
    assert blocks[500].prev_free is None and blocks[500].next_free is None


def test_free_queue_remove_ends_and_reappend() -> None:
    """Head, tail and middle removals keep the order; a removed block re-appended goes last."""
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    queue.remove(blocks[2])
    assert _ids(queue) == [1, 3]
    queue.append(blocks[2])
    assert _ids(queue) == [1, 3, 2]
    assert queue.popleft() is blocks[1]
    assert _ids(queue) == [3, 2]
    assert queue.num_free_blocks == 2


def test_free_queue_remove_of_absent_block_raises() -> None:
    """Removing a block that is not queued raises instead of corrupting the list."""
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[1])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[1])
    assert _ids(queue) == [0, 2]
    assert queue.num_free_blocks == 2


def test_free_queue_popleft_on_empty_raises() -> None:
    """popleft on an empty queue raises ValueError."""
    queue = FreeKVCacheBlockQueue([KVCacheBlock(0)])
    queue.popleft()
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()
    assert queue.num_free_blocks == 0


def test_pool_rejects_zero_blocks() -> None:
    """A pool needs at least one block."""
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, enable_caching=True)


def test_get_new_blocks_sets_ref_count_and_refuses_too_many() -> None:
    """New blocks leave the free queue with ref_cnt 1; asking for more than are free raises."""
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert _ids(blocks) == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.usage() == pytest.approx(0.75)
    with pytest.raises(ValueError, match="asked for 2 blocks, 1 free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1


def test_ref_counts_keep_shared_blocks_out_of_the_free_queue() -> None:
    """A block touched by a second holder joins the free queue only when both have freed it."""
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert block not in list(pool.free_queue)
    assert pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert list(pool.free_queue)[-1] is block
    assert pool.num_free_blocks == 2


def test_double_free_raises() -> None:
    """Freeing a block whose ref_cnt is already 0 raises and leaves the queue unchanged."""
    pool = BlockPool(3, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    before = _ids(pool.free_queue)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free_blocks([block])
    assert _ids(pool.free_queue) == before
    assert block.ref_cnt == 0


def test_touch_revives_a_free_cached_block_from_the_middle() -> None:
    """A prefix hit on a freed cached block takes it out of the free queue wherever it sits."""
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    for i, block in enumerate(blocks):
        pool.cache_block(block, _hash(i))
    pool.free_blocks(blocks)
    assert _ids(pool.free_queue) == [0, 1, 2, 3]
    hit = pool.get_cached_block(_hash(2))
    assert hit is blocks[2]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert _ids(pool.free_queue) == [0, 1, 3]
    assert pool.num_free_blocks == 3
    assert pool.get_cached_block(_hash(2)) is hit  # still cached while in use


def test_lru_evicts_tail_blocks_of_a_freed_request_first() -> None:
    """Blocks freed tail first are evicted tail first, after blocks that never held data."""
    pool = BlockPool(5, enable_caching=True)
    request_blocks = pool.get_new_blocks(3)
    for i, block in enumerate(request_blocks):
        pool.cache_block(block, _hash(i))
    pool.free_blocks(reversed(request_blocks))  # what KVCacheManager.free does
    assert _ids(pool.free_queue) == [3, 4, 2, 1, 0]
    assert _ids(pool.get_new_blocks(2)) == [3, 4]  # never used: no cached data lost
    (evicted,) = pool.get_new_blocks(1)
    assert evicted is request_blocks[2]
    assert pool.get_cached_block(_hash(2)) is None
    assert pool.get_cached_block(_hash(0)) is request_blocks[0]
    assert pool.get_cached_block(_hash(1)) is request_blocks[1]


def test_most_recently_freed_request_is_evicted_last() -> None:
    """Between two freed requests, the one freed earlier loses its blocks first."""
    pool = BlockPool(4, enable_caching=True)
    old, new = pool.get_new_blocks(2), pool.get_new_blocks(2)
    for i, block in enumerate(old + new):
        pool.cache_block(block, _hash(i))
    pool.free_blocks(reversed(old))
    pool.free_blocks(reversed(new))
    assert _ids(pool.get_new_blocks(2)) == [1, 0]
    assert pool.get_cached_block(_hash(2)) is new[0]
    assert pool.get_cached_block(_hash(0)) is None


def test_eviction_removes_the_hash() -> None:
    """A reallocated cached block loses its hash, and the hash no longer maps to any block."""
    pool = BlockPool(1, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, _hash(7))
    pool.free_blocks([block])
    assert pool.get_cached_block(_hash(7)) is block
    (again,) = pool.get_new_blocks(1)
    assert again is block
    assert block.block_hash is None
    assert pool.get_cached_block(_hash(7)) is None
    assert pool.cached_blocks == {}


def test_cache_block_first_writer_wins() -> None:
    """Two blocks with equal contents: the first stays mapped, evicting the second keeps it."""
    pool = BlockPool(3, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, _hash(1))
    pool.cache_block(second, _hash(1))
    assert pool.get_cached_block(_hash(1)) is first
    pool.cache_block(first, _hash(9))  # an already-cached block keeps its hash
    assert first.block_hash == _hash(1)
    assert pool.get_cached_block(_hash(9)) is None
    pool.free_blocks([second])
    pool.get_new_blocks(2)  # evicts block 2 (never used) and `second`
    assert second.block_hash is None
    assert pool.get_cached_block(_hash(1)) is first


def test_reset_prefix_cache_refused_while_blocks_are_in_use() -> None:
    """reset_prefix_cache returns False and keeps the map while any block is held, else clears."""
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, _hash(0))
    pool.cache_block(b, _hash(1))
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(_hash(0)) is a
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {}
    assert a.block_hash is None and b.block_hash is None
    assert pool.num_free_blocks == 3


def test_block_hash_chains_the_parent() -> None:
    """Equal tokens under different parents hash differently; equal chains hash equally."""
    root_a = hash_block_tokens(None, [1, 2])
    root_b = hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(root_a, [5, 6]) != hash_block_tokens(root_b, [5, 6])
    assert hash_block_tokens(root_a, [5, 6]) == hash_block_tokens(root_a, [5, 6])
    assert len(root_a) == 16
