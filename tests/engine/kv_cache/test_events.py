"""KV cache events of the block pool: replayed in order they give exactly its cached hashes, and
`cache_salt` keeps the prefix caches of different salts apart."""

from __future__ import annotations

import random
from collections.abc import Iterable

from baton.block_hash import block_hashes, external_hash, salt_root
from baton.engine.kv_cache.block_pool import BlockPool
from baton.engine.kv_cache.manager import KVCacheConfig, KVCacheManager
from baton.engine.request import Request
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from baton.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from tests.engine.scheduler.fakes import make_request, step

BS = 4


def _manager(num_blocks: int = 32, events: bool = True) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks, block_size=BS, enable_kv_cache_events=events))


def _request(req_id: str, prompt: list[int], salt: str | None = None) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=8), cache_salt=salt)


def _compute(manager: KVCacheManager, request: Request) -> int:
    """Looks up, allocates, "runs" and caches the whole request; returns its hit tokens."""
    hits, num_hit = manager.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit
    assert manager.allocate_slots(request, num_new, hits) is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request)
    return num_hit


def _replay(index: set[int], events: Iterable[KVCacheEvent]) -> set[int]:
    """What a subscriber's index holds after `events`."""
    for event in events:
        if isinstance(event, BlockStored):
            index.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            index.difference_update(event.block_hashes)
        else:
            index.clear()
    return index


def _cached(pool: BlockPool) -> set[int]:
    return {external_hash(h) for h in pool.cached_blocks}


def test_block_stored_carries_the_run_its_parent_and_tokens() -> None:
    """A computed prompt is one BlockStored of its full blocks (parent None, their tokens);
    a request extending it stores only its new blocks, parented on the last shared one."""
    manager = _manager()
    a = _request("a", list(range(10)))
    _compute(manager, a)
    (stored,) = manager.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [external_hash(h) for h in a.block_hashes]
    assert stored.parent_block_hash is None
    assert stored.token_ids == list(range(8)) and stored.block_size == BS
    assert (stored.lora_id, stored.medium) == (None, "GPU")

    b = _request("b", [*range(8), 20, 21, 22, 23, 24])
    assert _compute(manager, b) == 8
    (stored,) = manager.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [external_hash(b.block_hashes[2])]
    assert stored.parent_block_hash == external_hash(a.block_hashes[1])
    assert stored.token_ids == [20, 21, 22, 23]
    assert manager.take_events() == []


def test_first_writer_wins_stores_nothing_for_the_loser() -> None:
    """Two requests computing the same blocks side by side: only the first to cache them
    stores; the second's run of new blocks after them is parented on the first's block."""
    manager = _manager()
    a = _request("a", list(range(8)))
    b = _request("b", [*range(8), 30, 31, 32, 33])
    for request in (a, b):  # both allocated before either is cached: no hits
        assert manager.allocate_slots(request, request.num_tokens) is not None
        request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(a)
    manager.cache_blocks(b)
    first, second = manager.take_events()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.block_hashes == [external_hash(h) for h in a.block_hashes]
    assert second.block_hashes == [external_hash(b.block_hashes[2])]
    assert second.parent_block_hash == external_hash(b.block_hashes[1])
    assert _replay(set(), [first, second]) == _cached(manager.pool)


def test_eviction_and_reset_are_removed_and_cleared() -> None:
    """Reusing a cached free block is a BlockRemoved of its hash; a reset, AllBlocksCleared."""
    manager = _manager(num_blocks=4)
    a = _request("a", list(range(16)))
    _compute(manager, a)
    manager.free(a)
    index = _replay(set(), manager.take_events())
    assert len(index) == 4
    b = _request("b", list(range(100, 108)))
    _compute(manager, b)
    events = manager.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(removed) == 1 and len(removed[0].block_hashes) == 2
    assert _replay(index, events) == _cached(manager.pool)
    manager.free(b)
    assert manager.reset_prefix_cache()
    assert manager.take_events() == [AllBlocksCleared()]


def test_events_off_records_nothing() -> None:
    """Without events the pool keeps no list at all (the hot path's one check)."""
    manager = _manager(events=False)
    _compute(manager, _request("a", list(range(12))))
    assert manager.pool.events is None
    assert manager.take_events() == []


def test_replayed_events_equal_the_cached_set_at_every_step() -> None:
    """A scheduler under memory pressure (prefix hits, evictions, preemptions, a reset): after
    every step, replaying every event so far gives exactly the pool's cached hashes."""
    rng = random.Random(7)
    sched = Scheduler(
        SchedulerConfig(max_model_len=64, max_num_seqs=6, max_num_batched_tokens=64),
        KVCacheConfig(num_blocks=20, block_size=BS, enable_kv_cache_events=True),
    )
    pool = sched.kv.pool
    prefixes = [[rng.randrange(1, 500) for _ in range(12)] for _ in range(3)]
    index: set[int] = set()
    num_removed = num_steps = 0
    for wave in range(2):
        for i in range(12):
            prompt = rng.choice(prefixes) + [rng.randrange(1, 500) for _ in range(rng.randrange(9))]
            sched.add_request(
                make_request(f"{wave}-{i}", prompt=prompt, max_tokens=rng.randrange(4, 24))
            )
        while sched.has_unfinished_requests():
            tokens = {rid: rng.randrange(1, 500) for rid in sched.requests}
            step(sched, tokens=tokens)
            events = sched.kv.take_events()
            num_removed += sum(isinstance(e, BlockRemoved) for e in events)
            assert _replay(index, events) == _cached(pool)
            num_steps += 1
            assert num_steps < 2000
        assert sched.reset_prefix_cache()
        assert _replay(index, sched.kv.take_events()) == _cached(pool) == set()
    stats = sched.make_stats()
    assert stats.num_preemptions > 0 and num_removed > 0 and stats.prefix_cache_hits > 0


def test_salts_keep_prefix_caches_apart() -> None:
    """The same prompt under another salt (or none) hits nothing; under its own salt it hits.
    A salted first block's hash chains from the salt, and its event's parent is None."""
    manager = _manager()
    prompt = list(range(13))
    a = _request("a", prompt, salt="tenant-a")
    assert _compute(manager, a) == 0
    (stored,) = manager.take_events()
    assert isinstance(stored, BlockStored) and stored.parent_block_hash is None
    assert a.block_hashes == block_hashes(prompt, BS, "tenant-a")
    assert a.block_hashes[0] != block_hashes(prompt, BS)[0]
    assert salt_root("tenant-a") is not None

    hits_before = manager.stats.hits
    assert _compute(manager, _request("b", prompt, salt="tenant-b")) == 0
    assert _compute(manager, _request("c", prompt)) == 0
    assert manager.stats.hits == hits_before
    assert _compute(manager, _request("d", prompt, salt="tenant-a")) == 12
    assert manager.stats.hits == hits_before + 12
