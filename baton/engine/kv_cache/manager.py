"""KV cache manager: which blocks each request holds, prefix-cache lookups, and allocation.

With a sliding window on every layer (`KVCacheConfig.sliding_window`), a block that lies wholly
before the window of a request's next token is never read again: the manager gives it back to
the pool (still cached, so other requests' prefix hits can use it until it is evicted) and does
not take prefix hits that lie there. Such a position of the request's block list holds
`KVCacheManager.skipped`; the worker sees block id 0 there and never reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from baton.block_hash import block_hashes
from baton.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from baton.engine.request import Request
from baton.kv_events import KVCacheEvent
from baton.kv_transfer.params import cdiv


@dataclass(frozen=True)
class KVCacheConfig:
    """Shape of the paged cache as the scheduler sees it."""

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_kv_cache_events: bool = False  # record the hash map's changes (`take_events`)
    # Every layer's keys lie within this many positions of the query (the largest window);
    # None when some layer attends the whole context.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


@dataclass
class PrefixCacheStats:
    """Counters in tokens, as vLLM's `prefix_cache_queries` / `prefix_cache_hits` count them."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    """Allocates paged blocks to requests; the scheduler's only view of KV memory."""

    def __init__(self, config: KVCacheConfig) -> None:
        self.block_size = config.block_size
        self.enable_caching = config.enable_prefix_caching
        self.pool = BlockPool(
            config.num_blocks, config.enable_prefix_caching, config.enable_kv_cache_events
        )
        self.sliding_window = config.sliding_window
        # Positional: entry i holds tokens [i * block_size, (i + 1) * block_size).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the hash map.
        self._num_cached_blocks: dict[str, int] = {}
        # How many leading entries of each request's list are `skipped` (behind its window).
        self._num_skipped: dict[str, int] = {}
        # Stands for a block behind the window: given back, or a prefix hit never taken.
        self.skipped = KVCacheBlock(-1)
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table; 0 (any valid id: never read) behind its window."""
        return [max(b.block_id, 0) for b in self.req_to_blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds a reference on (not counting those behind its window)."""
        blocks = self.req_to_blocks.get(request_id, ())
        return len(blocks) - self._num_skipped.get(request_id, 0)

    def _window_start_block(self, request: Request, num_computed: int) -> int:
        """How many leading blocks lie wholly before the window of the token at position
        `num_computed` (the next one computed), so no later token reads them. 0 without a
        window, and for requests whose blocks a KV connector reads or writes (their transfers
        move whole prompts)."""
        window = self.sliding_window
        if window is None or request.kv_transfer_params is not None:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    def _release_behind_window(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """Gives back the request's blocks that fell behind its window, oldest first (so they
        are the first evicted); cached ones stay findable by prefix until then."""
        req_id = request.request_id
        done = self._num_skipped.get(req_id, 0)
        end = min(self._window_start_block(request, request.num_computed_tokens), len(blocks))
        if end <= done:
            return
        freed = [b for b in blocks[done:end] if b is not self.skipped]
        blocks[done:end] = [self.skipped] * (end - done)
        self._num_skipped[req_id] = end
        self.pool.free_blocks(freed)

    def _update_block_hashes(self, request: Request) -> None:
        """Hashes the request's new full blocks; its first block's chain starts at its salt."""
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            request.block_hashes = block_hashes(
                request.all_token_ids,
                self.block_size,
                request.cache_salt,
                start=request.block_hashes,
            )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in whole blocks; side-effect free on the pool.

        At least the last token is always left to compute: its logits are needed to sample.
        A request asking for prompt logprobs gets no hits (and counts no query), as in vLLM:
        a cached position's logits were never kept, so every prompt position must be computed.
        """
        if not self.enable_caching:
            return [], 0
        params = request.sampling_params
        if params is not None and params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Makes room for `num_new_tokens` more tokens after the computed ones.

        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks` (first schedule
        only); those behind the window of the first token to compute are not taken. Returns the
        newly allocated blocks, or None when they do not fit; either way, blocks that fell behind
        the request's window are given back first, and nothing else changes on None.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        hits = new_computed_blocks or []
        held = self.req_to_blocks.get(request.request_id)
        if held is not None and self.sliding_window is not None:
            self._release_behind_window(request, held)
        num_held = len(held) if held is not None else 0
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_tokens_after = num_computed + num_new_tokens
        num_needed = cdiv(num_tokens_after, self.block_size) - num_held - len(hits)
        if num_needed <= 0 and not hits:
            return []  # the common decode step: the last block still has room
        # Hits behind the window are not needed: their positions stay `skipped`.
        num_behind = max(0, self._window_start_block(request, num_computed) - num_held)
        num_behind = min(num_behind, len(hits))
        taken = hits[num_behind:]
        # Hits sitting in the free queue stop being free once touched.
        num_revived = sum(1 for b in taken if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_revived:
            return None
        self.pool.touch(taken)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if num_behind:
            blocks.extend([self.skipped] * num_behind)
            self._num_skipped[request.request_id] = num_held + num_behind
        blocks.extend(taken)
        blocks.extend(new_blocks)
        if hits:
            self._num_cached_blocks[request.request_id] = len(hits)
        return new_blocks

    def cache_blocks(self, request: Request) -> None:
        """Registers the request's full, computed blocks in the prefix cache.

        Called after the step that computed them ran, never at allocation: a block allocated in a
        step whose request is then preempted was never written and must not be found.
        """
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        # With async scheduling num_computed_tokens can run ahead of the known tokens.
        num_computed = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(num_computed // self.block_size, len(blocks))
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        # Blocks given back before they were cached (async scheduling) are skipped.
        start = max(start, self._num_skipped.get(request.request_id, 0))
        if start < num_full:
            self.pool.cache_full_blocks(
                blocks,
                request.block_hashes,
                start,
                num_full,
                request.all_token_ids,
                self.block_size,
            )
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Releases the request's blocks; tail blocks first in the free queue, so that shared
        prefixes (at the head) are the last to be evicted."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        num_skipped = self._num_skipped.pop(request.request_id, 0)
        if blocks:
            self.pool.free_blocks(reversed(blocks[num_skipped:]))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix cache's changes since the last call (KV cache events; none when off)."""
        return self.pool.take_events()
