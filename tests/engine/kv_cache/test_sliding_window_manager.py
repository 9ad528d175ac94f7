"""The KV cache manager with a sliding window on every layer: blocks behind a request's window go
back to the pool (cached ones stay findable), prefix hits behind it are never taken, and prefix
caching stays correct."""

from __future__ import annotations

from baton.engine.kv_cache.manager import KVCacheConfig, KVCacheManager
from baton.engine.request import Request
from baton.engine.sampling_params import SamplingParams

BS = 4
WINDOW = 8  # two blocks


def _manager(num_blocks: int = 32, window: int | None = WINDOW) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks, block_size=BS, sliding_window=window))


def _request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=200))


def _run(manager: KVCacheManager, request: Request, n: int, hits: int = 0) -> None:
    """Allocates, "runs" and caches `n` tokens of the request (after `hits` cached ones)."""
    blocks, num_hit = manager.get_computed_blocks(request) if hits else ([], 0)
    assert num_hit == hits
    assert manager.allocate_slots(request, n, blocks) is not None
    request.num_computed_tokens += num_hit + n
    manager.cache_blocks(request)


def _decode(manager: KVCacheManager, request: Request, steps: int) -> None:
    for _ in range(steps):
        request.append_output_token(7)
        _run(manager, request, 1)


def test_blocks_behind_the_window_go_back_cached() -> None:
    """After a 24-token prompt, the next token's window (positions 17..24) starts in block 4:
    blocks 0-3 are given back, still in the prefix cache, and reported as id 0."""
    manager = _manager()
    request = _request("a", list(range(100, 124)))
    _run(manager, request, 24)
    blocks = list(manager.req_to_blocks["a"])
    assert manager.num_held_blocks("a") == 6
    _decode(manager, request, 1)
    assert manager.num_held_blocks("a") == 3  # blocks 4, 5 and the new 6
    assert manager.num_free_blocks == 32 - 3
    assert manager.block_ids("a")[:4] == [0, 0, 0, 0]
    assert manager.block_ids("a")[4:6] == [b.block_id for b in blocks[4:6]]
    for block, block_hash in zip(blocks[:4], request.block_hashes[:4], strict=True):
        assert block.ref_cnt == 0
        assert manager.pool.get_cached_block(block_hash) is block


def test_held_blocks_stay_bounded_while_decoding() -> None:
    """A long decode holds at most the window's blocks plus the one being filled; without a
    window it holds them all; both give every block back when freed."""
    for window, bound in ((WINDOW, WINDOW // BS + 1), (None, None)):
        manager = _manager(window=window)
        request = _request("a", list(range(10)))
        _run(manager, request, 10)
        held = []
        for _ in range(60):
            _decode(manager, request, 1)
            held.append(manager.num_held_blocks("a"))
        if bound is None:
            assert held[-1] == -(-70 // BS)
        else:
            assert max(held) <= bound
        manager.free(request)
        assert manager.num_free_blocks == 32


def test_prefix_hits_behind_the_window_are_not_taken() -> None:
    """A second request with the same 24-token prefix hits all its full blocks but takes only
    those its first computed token can see; the others stay free (and cached)."""
    manager = _manager()
    prompt = list(range(200, 224))
    a = _request("a", prompt)
    _run(manager, a, 24)
    manager.free(a)
    b = _request("b", [*prompt, 1, 2, 3])
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 24
    new = manager.allocate_slots(b, 3, hits)
    assert new is not None
    # The first computed token sits at position 24: its window opens at 17, in block 4.
    assert [blk.ref_cnt for blk in hits] == [0, 0, 0, 0, 1, 1]
    assert manager.block_ids("b")[:4] == [0, 0, 0, 0]
    assert manager.block_ids("b")[4:6] == [blk.block_id for blk in hits[4:]]
    assert manager.num_held_blocks("b") == 3
    b.num_computed_tokens = 27
    manager.cache_blocks(b)
    manager.free(b)
    assert manager.num_free_blocks == 32
    assert all(blk.ref_cnt == 0 for blk in manager.pool.blocks)


def test_a_block_evicted_after_release_ends_the_prefix_hit() -> None:
    """Blocks given back mid-sequence are evicted first; once one is gone, a later request's hit
    stops before it (the chain is never bridged), and every hit it gets holds its own tokens."""
    manager = _manager(num_blocks=12)
    prompt = list(range(300, 332))  # 8 blocks
    a = _request("a", prompt)
    _run(manager, a, 32)
    _decode(manager, a, 1)  # blocks 0-5 go back, oldest first in the free queue
    filler = _request("f", list(range(900, 916)))  # 4 blocks: the free ones first, then 0 and 1
    _run(manager, filler, 16)
    b = _request("b", [*prompt, 5])
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 0 and hits == []  # block 0 was evicted: nothing after it is used
    c = _request("c", [*range(900, 916), 1])
    hits, num_hit = manager.get_computed_blocks(c)
    assert num_hit == 16
    for blk, block_hash in zip(hits, c.block_hashes, strict=True):
        assert blk.block_hash == block_hash


def test_blocks_released_before_they_were_cached() -> None:
    """With async scheduling a request's computed count can pass blocks not yet cached; those
    are given back uncached and later caching skips them without error."""
    manager = _manager()
    request = _request("a", list(range(40)))
    assert manager.allocate_slots(request, 20) is not None
    request.num_computed_tokens = 20  # ran, not yet cached
    assert manager.allocate_slots(request, 20) is not None  # blocks 0-2 behind the window
    request.num_computed_tokens = 40
    manager.cache_blocks(request)
    assert manager.num_held_blocks("a") == 10 - 3
    for i, blk in enumerate(manager.req_to_blocks["a"][3:], start=3):
        assert blk.block_hash == request.block_hashes[i]
    manager.free(request)
    assert manager.num_free_blocks == 32


def test_requests_with_kv_transfer_keep_every_block() -> None:
    """Blocks a KV connector may read or write (requests with kv_transfer_params) are never
    given back early: their transfers move whole prompts."""
    manager = _manager()
    request = _request("a", list(range(24)))
    request.kv_transfer_params = object()  # type: ignore[assignment]  # only its presence counts
    _run(manager, request, 24)
    _decode(manager, request, 5)
    assert manager.num_held_blocks("a") == 8
    assert all(blk.ref_cnt == 1 for blk in manager.req_to_blocks["a"])
