"""The router's exact index follows a real engine's KV events: after stores, prefix hits,
evictions under pressure, preemption and a restart of the engine on the same ports, the index
equals the engine's block pool's cached set; a gap the replay buffer no longer covers is a
resync, never an invented block. The engine runs in-process (`LLM`), so the test can read its
pool; the router's subscription runs on an event loop beside it, over real ZMQ sockets."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from baton import LLM, SamplingParams
from baton.block_hash import HASH_SCHEME, external_hash
from baton.engine.kv_cache.publisher import KVEventPublisher
from baton.kv_events import AllBlocksCleared, BlockStored, KVEventsConfig
from baton.router.kv_index import KVIndex
from baton.router.kv_subscriber import Subscriptions, source_of
from tests.support.ports import free_port

BS = 16
URL = "http://127.0.0.1:1"  # the engine's URL as discovery gives it: only its host is used


def _config(port: int, replay_port: int, **fields: Any) -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        **fields,
    )


def _health(port: int, replay_port: int) -> dict[str, Any]:
    """What the engine's /health says (the host part is the engine's to choose: ignored)."""
    return {
        "kv_events": {
            "endpoint": f"tcp://0.0.0.0:{port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
            "topic": "",
            "block_size": BS,
            "hash": HASH_SCHEME,
        }
    }


async def _until(check: Any, what: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out: {what if isinstance(what, str) else what()}")
        await asyncio.sleep(0.02)


def test_the_index_equals_the_engines_cached_set(tiny_model: Any) -> None:
    port, replay_port = free_port(), free_port()
    model = str(Path(tiny_model("llama")))

    def engine() -> LLM:
        return LLM(
            model,
            max_model_len=128,
            block_size=BS,
            num_gpu_blocks_override=14,
            max_num_seqs=4,
            kv_events_config=_config(port, replay_port),
        )

    async def main() -> None:
        llm = engine()
        index = KVIndex()
        subs = Subscriptions(index)

        def cached() -> set[int]:
            return {external_hash(h) for h in llm.engine.scheduler.kv.pool.cached_blocks}

        async def run(prompts: list[list[int]], max_tokens: int) -> None:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            inputs: Any = [{"prompt_token_ids": p} for p in prompts]
            await asyncio.to_thread(llm.generate, inputs, params)
            await _until(
                lambda: index.hashes(URL) == cached(),
                lambda: (
                    f"index {len(index.hashes(URL))} != pool {len(cached())}: {subs.describe(URL)}"
                ),
            )

        try:
            # Stores before the router subscribes: the replay of its history indexes them.
            system = [(7 * i) % 500 + 3 for i in range(48)]
            await asyncio.to_thread(
                llm.generate,
                [{"prompt_token_ids": system + [100 + i] * 8} for i in range(2)],
                SamplingParams(max_tokens=2, temperature=0.0),
            )
            subs.sync(URL, _health(port, replay_port))
            await _until(lambda: index.hashes(URL) == cached() != set(), "history replayed")
            # Prefix hits (the system prompt again), then evictions: more than the pool holds.
            await run([system + [200 + i] * 8 for i in range(3)], 2)
            await run([[(13 * i + j) % 500 + 3 for j in range(64)] for i in range(6)], 2)
            # Preemption: four long answers in a pool of 14 blocks.
            before = llm.engine.scheduler.num_preemptions
            await run([[(17 * i + j) % 500 + 3 for j in range(20)] for i in range(4)], 60)
            assert llm.engine.scheduler.num_preemptions > before, "no preemption happened"
            sub = subs._subs[URL]
            assert sub.gaps == sub.restarts == 0
            # A restart on the same ports: the new process numbers from 0 again, and its first
            # batches may pass before the subscription is back; the reconnection (or a batch
            # numbered below what it expects, and newer) makes the engine's entries start over.
            await asyncio.to_thread(llm.shutdown)
            llm = engine()
            await run([system + [7] * 8], 2)
            assert sub.reconnects + sub.restarts >= 1 and sub.resyncs == 0
            # /health names another process: the router resubscribes from scratch at once.
            subs.sync(
                URL,
                {
                    **_health(port, replay_port),
                    "kv_events": {
                        **_health(port, replay_port)["kv_events"],
                        "instance": "after-restart",
                    },
                },
            )
            assert subs._subs[URL] is not sub
            await _until(lambda: index.hashes(URL) == cached() != set(), "resubscribed")
        finally:
            await subs.close()
            await asyncio.to_thread(llm.shutdown)

    asyncio.run(main())


def test_a_gap_past_the_replay_buffer_resyncs() -> None:
    """Batches published while the router was away, more than the buffer keeps: the index
    drops the engine's entries and rebuilds from what is left; it never holds a block the
    engine removed."""
    port, replay_port = free_port(), free_port()
    publisher = KVEventPublisher(_config(port, replay_port, buffer_steps=3))

    async def main() -> None:
        index = KVIndex()
        subs = Subscriptions(index)
        try:
            publisher.publish([AllBlocksCleared()])
            for h in range(1, 7):  # seq 1..6; the buffer keeps 4..6
                publisher.publish([BlockStored([h], None, [h] * BS, BS)])
            await asyncio.sleep(0.2)
            subs.sync(URL, _health(port, replay_port))
            await _until(lambda: index.hashes(URL) == {4, 5, 6}, "resynced from the buffer")
            sub = subs._subs[URL]
            assert sub.resyncs == 1 and sub.expected == 7
            publisher.publish([BlockStored([7], None, [7] * BS, BS)])
            await _until(lambda: 7 in index.hashes(URL), "the live stream applied")
        finally:
            await subs.close()

    try:
        asyncio.run(main())
    finally:
        publisher.shutdown()


def test_the_source_is_the_engines_host_and_its_ports_only() -> None:
    """The router connects to the engine's own host whatever /health says the host is, and
    follows no engine that publishes another hash scheme or a non-TCP endpoint."""
    health = _health(5557, 5558)
    health["kv_events"]["endpoint"] = "tcp://evil.example:5557"
    source = source_of("http://10.1.2.3:8000", health)
    assert source is not None and source.endpoint == "tcp://10.1.2.3:5557"
    assert source.replay_endpoint == "tcp://10.1.2.3:5558"
    assert source_of("http://[fd00::1]:8000", health).endpoint == "tcp://[fd00::1]:5557"  # type: ignore[union-attr]
    for change in ({"hash": "xxhash"}, {"endpoint": "ipc:///tmp/x"}, {"block_size": 0}):
        bad = _health(5557, 5558)
        bad["kv_events"].update(change)
        assert source_of("http://10.1.2.3:8000", bad) is None
    assert source_of("http://10.1.2.3:8000", {"kv_events": None}) is None
