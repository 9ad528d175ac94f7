"""The pool of paged KV blocks: reference counts, the free queue, and the prefix-cache hash map.

With KV cache events on, the pool records every change of the hash map as vLLM's events
(`baton.kv_events`): replayed in order they give exactly the hashes in `cached_blocks`, which is
what the router's index relies on.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from baton.block_hash import BlockHash, external_hash
from baton.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


class KVCacheBlock:
    """Metadata of one block of the KV tensor (the data lives in the worker's tensor)."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set once the block is full and cached
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order (least recently freed first).

    Not a `deque`: a prefix-cache hit revives a free cached block from the middle of the queue,
    which must be O(1). An intrusive doubly linked list through the blocks gives that.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self._head = KVCacheBlock(-1)  # sentinels keep insert/remove branch-free
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Owns every block; hands out free ones, evicting cached free blocks in LRU order."""

    def __init__(
        self, num_blocks: int, enable_caching: bool, enable_kv_cache_events: bool = False
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        # Changes of `cached_blocks` not yet taken; None when events are off (one check on the
        # hot path).
        self.events: list[KVCacheEvent] | None = [] if enable_kv_cache_events else None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes `num_blocks` free blocks (the caller has checked there are enough)."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = []
        events = self.events
        evicted: list[int] = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # evict: its contents are about to be overwritten
                if self.cached_blocks.get(block.block_hash) is block:
                    del self.cached_blocks[block.block_hash]
                    if events is not None:
                        evicted.append(external_hash(block.block_hash))
                block.block_hash = None
            block.ref_cnt = 1
            blocks.append(block)
        if evicted and events is not None:
            events.append(BlockRemoved(evicted))
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on prefix-cache hits, reviving them from the free queue if needed."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference each; blocks reaching zero join the free queue in the given order
        (so the first given is the first evicted)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Marks a full, computed block as reusable under `block_hash` (first writer wins).
        True when the hash entered the map (no other block held it)."""
        if block.block_hash is not None:
            return False
        block.block_hash = block_hash
        return self.cached_blocks.setdefault(block_hash, block) is block

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        start: int,
        end: int,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        """Caches one request's blocks [start, end) under their hashes; `token_ids` are the
        request's. With events on, each run of blocks that entered the map is one BlockStored,
        its parent the hash of the block before it (None for a request's first block, salted
        or not: vLLM sends only a real block's hash)."""
        events = self.events
        if events is None:
            for i in range(start, end):
                self.cache_block(blocks[i], block_hashes[i])
            return
        run_start: int | None = None
        for i in range(start, end):
            if self.cache_block(blocks[i], block_hashes[i]):
                if run_start is None:
                    run_start = i
            elif run_start is not None:
                events.append(_stored(block_hashes, run_start, i, token_ids, block_size))
                run_start = None
        if run_start is not None:
            events.append(_stored(block_hashes, run_start, end, token_ids, block_size))

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self.cached_blocks.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first (none when events are off)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events


def _stored(
    block_hashes: Sequence[BlockHash],
    start: int,
    end: int,
    token_ids: Sequence[int],
    block_size: int,
) -> BlockStored:
    """The event of blocks [start, end) of one request entering the map."""
    return BlockStored(
        block_hashes=[external_hash(h) for h in block_hashes[start:end]],
        parent_block_hash=external_hash(block_hashes[start - 1]) if start else None,
        token_ids=list(token_ids[start * block_size : end * block_size]),
        block_size=block_size,
    )
