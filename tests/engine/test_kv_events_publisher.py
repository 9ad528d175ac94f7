"""KV cache events over real ZMQ sockets, read by a decoder written from vLLM's published format
(tests/support/vllm_kv_events.py), not from Baton's structs: the publisher alone, then an
in-process engine whose subscriber's index equals its block pool's cached set."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from baton import LLM, SamplingParams
from baton.block_hash import block_hashes, external_hash
from baton.engine.config import EngineArgs
from baton.engine.kv_cache.publisher import KVEventPublisher
from baton.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventsConfig
from tests.support.ports import free_port
from tests.support.vllm_kv_events import Subscriber, apply, decode

BS = 16
TOPIC = b"kv@test"


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.term()


def _config(port: int, replay_port: int, **fields: Any) -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://127.0.0.1:{port}",  # an address of this machine: bound
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic=TOPIC.decode(),
        **fields,
    )


# ---- the publisher alone ---------------------------------------------------------------------


def test_publisher_sends_numbered_batches_and_replays_the_buffered_ones(
    ctx: zmq.Context[Any],
) -> None:
    """Batches go out as [topic, seq, payload] from seq 0; a replay from seq 1 returns the ones
    still buffered (buffer_steps 3: seqs 2-4) and then END_SEQ."""
    port, replay_port = free_port(), free_port()
    publisher = KVEventPublisher(_config(port, replay_port, buffer_steps=3))
    sub = Subscriber(ctx, port, replay_port, TOPIC)
    try:
        for i in range(5):
            publisher.publish([BlockStored([i], None, list(range(BS)), BS)])
        got = [sub.recv() for _ in range(5)]
        assert [g[0] for g in got if g is not None] == [0, 1, 2, 3, 4]
        ts, events, rank = decode(got[4][1])  # type: ignore[index]
        assert abs(ts - time.time()) < 60 and rank == 0
        assert events == [["BlockStored", [4], None, list(range(BS)), BS, None, "GPU"]]
        replayed = sub.replay(1)
        assert [seq for seq, _ in replayed] == [2, 3, 4]
        assert replayed[0][1] == got[2][1]  # type: ignore[index]
        assert sub.replay(9) == []
        publisher.publish([BlockRemoved([4]), AllBlocksCleared()])
        last = sub.recv()
        assert last is not None and last[0] == 5
        assert decode(last[1])[1] == [["BlockRemoved", [4], "GPU"], ["AllBlocksCleared"]]
    finally:
        sub.close()
        publisher.shutdown()


def test_publisher_binds_addresses_of_this_machine_and_connects_to_others(
    ctx: zmq.Context[Any],
) -> None:
    """`tcp://127.0.0.1:P` is bound (a subscriber connects to it); an address that is not this
    machine's is connected to (vLLM's collector mode: the collector binds), without an error."""
    port = free_port()
    publisher = KVEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}")
    )
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 5
        while not sub.poll(100):  # the subscription is up once a batch gets through
            assert time.monotonic() < deadline, "nothing reached the subscriber"
            publisher.publish([AllBlocksCleared()])
        topic, _, payload = sub.recv_multipart()
        assert topic == b"" and decode(payload)[1] == [["AllBlocksCleared"]]
    finally:
        sub.close(linger=0)
        publisher.shutdown()
    elsewhere = KVEventPublisher(  # TEST-NET-1: never an address of this machine
        KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://192.0.2.1:{free_port()}")
    )
    elsewhere.publish([AllBlocksCleared()])
    elsewhere.shutdown(timeout=0.5)


def test_an_endpoint_in_use_fails_the_start() -> None:
    """A port already bound is a ValueError naming the endpoint, not a silent thread."""
    port, replay_port = free_port(), free_port()
    first = KVEventPublisher(_config(port, replay_port))
    try:
        with pytest.raises(ValueError, match=f"tcp://127.0.0.1:{port}"):
            KVEventPublisher(_config(port, free_port()))
        with pytest.raises(ValueError, match=f"tcp://127.0.0.1:{replay_port}"):
            KVEventPublisher(_config(free_port(), replay_port))
    finally:
        first.shutdown()


@pytest.mark.parametrize("endpoint", ["tcp://*:0", "tcp://127.0.0.1:*"])
def test_a_port_the_system_picks_is_refused(endpoint: str) -> None:
    """Subscribers find the port in /health ahead of time: port 0 or `*` is refused."""
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint)
    with pytest.raises(ValueError, match="fixed port"):
        EngineArgs(kv_events_config=config)
    with pytest.raises(ValueError, match="fixed port"):
        EngineArgs(kv_events_config=KVEventsConfig(True, replay_endpoint=endpoint))
    EngineArgs(kv_events_config=KVEventsConfig(endpoint=endpoint))  # off: not checked


# ---- an engine -------------------------------------------------------------------------------


def _drain(sub: Subscriber, index: set[int], pool_set: set[int], last_seq: int) -> int:
    """Applies published batches until the index equals the pool's set; returns the last seq
    (checking that they come one after another). A batch at or before `last_seq` came from the
    replay already (published while the subscription was being set up) and is skipped."""
    while index != pool_set:
        got = sub.recv()
        assert got is not None, f"index {len(index)} hashes, pool {len(pool_set)}"
        seq, payload = got
        if seq <= last_seq:
            continue
        assert seq == last_seq + 1
        apply(index, payload, BS)
        last_seq = seq
    return last_seq


def test_an_engine_publishes_its_prefix_cache(tiny_model: Any, ctx: zmq.Context[Any]) -> None:
    """An in-process engine: AllBlocksCleared at seq 0 (replayed to a late subscriber), stores
    and evictions keep the subscriber's index equal to the pool's cached set, a new subscriber
    rebuilds it by replay alone, and a reset clears it."""
    port, replay_port = free_port(), free_port()
    llm = LLM(
        str(Path(tiny_model("llama"))),
        max_model_len=128,
        block_size=BS,
        num_gpu_blocks_override=12,
        max_num_seqs=2,
        kv_events_config=_config(port, replay_port),
    )
    pool = llm.engine.scheduler.kv.pool

    def cached() -> set[int]:
        return {external_hash(h) for h in pool.cached_blocks}

    sub = Subscriber(ctx, port, replay_port, TOPIC)
    late: Subscriber | None = None
    try:
        index: set[int] = set()
        replayed = sub.replay(0)
        assert replayed[0][0] == 0 and apply(index, replayed[0][1], BS) == ["AllBlocksCleared"]
        last_seq = replayed[-1][0]
        for _, payload in replayed[1:]:
            apply(index, payload, BS)

        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        system = [(7 * i) % 500 + 3 for i in range(40)]
        prompts = [{"prompt_token_ids": system + [100 + i] * 10} for i in range(3)]
        llm.generate(prompts, params)
        last_seq = _drain(sub, index, cached(), last_seq)
        assert index and index == cached()
        # The first block of an unsalted prompt is stored with no parent: its hash is
        # block_hashes' over the prompt's own tokens.
        first = external_hash(block_hashes(system, BS)[0])
        assert first in index

        # More distinct prompts than the cache holds: blocks are evicted and removed.
        tags: list[str] = []
        others = [
            {"prompt_token_ids": [(13 * i + j) % 500 + 3 for j in range(60)]} for i in range(6)
        ]
        llm.generate(others, params)
        while index != cached():
            got = sub.recv()
            assert got is not None and got[0] == last_seq + 1
            tags += apply(index, got[1], BS)
            last_seq = got[0]
        assert "BlockRemoved" in tags
        assert first not in index

        # A subscriber that saw nothing rebuilds the index from the replay buffer.
        late = Subscriber(ctx, port, replay_port, TOPIC)
        rebuilt: set[int] = set()
        for _, payload in late.replay(0):
            apply(rebuilt, payload, BS)
        assert rebuilt == cached()

        assert llm.reset_prefix_cache()
        got = sub.recv()
        assert got is not None and got[0] == last_seq + 1
        assert apply(index, got[1], BS) == ["AllBlocksCleared"] and index == cached() == set()
    finally:
        sub.close()
        if late is not None:
            late.close()
        llm.shutdown()


def test_cache_salt_through_the_offline_api(tiny_model: Any) -> None:
    """A prompt dict's `cache_salt`: another salt's repeat of a prompt hits nothing, the same
    salt's hits (the engine's prefix-cache hit counter); an empty salt is refused."""
    llm = LLM(str(Path(tiny_model("llama"))), max_model_len=128, block_size=BS)
    stats = llm.engine.scheduler.kv.stats
    prompt = [(11 * i) % 500 + 3 for i in range(40)]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    try:
        llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, params)
        hits = stats.hits
        (b,) = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}, params)
        (plain,) = llm.generate({"prompt_token_ids": prompt}, params)
        assert stats.hits == hits and b.num_cached_tokens == plain.num_cached_tokens == 0
        (a,) = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, params)
        assert a.num_cached_tokens == 32 and stats.hits == hits + 32
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate({"prompt_token_ids": prompt, "cache_salt": ""}, params)
    finally:
        llm.shutdown()
