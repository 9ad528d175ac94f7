"""Prefix-aware routing over 4 real engines: 8 shared system prompts x 32 users.

Each engine's KV pool holds about two system prompts, so where a request lands decides whether
its system prompt is still cached. The engines' own counters (`vllm:prefix_cache_hits` over
`vllm:prefix_cache_queries`) measure four placements of fresh prompt families: an oracle
that pins each system prompt to one engine, the router's round-robin, and the router's
prefix-aware policy on the exact index (the engines' KV events) and on the approximate one.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from baton.router.config import PolicyName, RouterConfig
from baton.router.discovery import Endpoint
from tests.router.harness import RouterServer
from tests.support.engine_server import NAME, Server, start_all, stop_all
from tests.support.ports import free_port
from tests.support.thread_server import scrape

# Load, not behaviour: 768 requests over 4 engines measure the policy's hit rate (the figure in
# docs/benchmarks.md); what the policy decides is tested in test_policies.py and
# test_prefix_index.py, and the router's prefix routing over fake engines in test_routing.py.
pytestmark = [pytest.mark.slow, pytest.mark.long]

NUM_ENGINES, NUM_FAMILIES, NUM_USERS = 4, 8, 32
# ~10 engine blocks per system prompt: two families and a running request fit, three do not.
ENGINE_FLAGS = ("--num-gpu-blocks-override", "34", "--max-num-seqs", "4", "--max-model-len", "512")
WORDS = ["baton", "relay", "runner", "zone", "track", "lane", "pass", "sprint", "medal", "team"]


def _system_prompt(phase: str, family: int) -> str:
    rng = random.Random(f"{phase}-{family}")
    return f"[{phase} {family}] " + " ".join(rng.choice(WORDS) for _ in range(30))


def _workload(phase: str) -> list[tuple[int, str]]:
    """(family, prompt) pairs in a shuffled order, so no placement follows from arrival order."""
    pairs = [
        (f, f"{_system_prompt(phase, f)}\nUser {u}: question {u * 7 % 13}?")
        for f in range(NUM_FAMILIES)
        for u in range(NUM_USERS)
    ]
    random.Random(phase).shuffle(pairs)
    return pairs


@pytest.fixture(scope="module")
def engines(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    model = Path(tiny_model("llama"))
    logs = tmp_path_factory.mktemp("prefix-engines")
    flags = {f"engine-{i}": (*ENGINE_FLAGS, *_events_flags()) for i in range(NUM_ENGINES)}
    servers = start_all(model, logs, flags)
    try:
        yield list(servers.values())
    finally:
        stop_all(servers.values())


def _events_flags() -> tuple[str, str]:
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
    }
    return "--kv-events-config", json.dumps(config)


def _counters(engines: list[Server]) -> tuple[float, float]:
    hits = sum(scrape(e.url, "vllm:prefix_cache_hits_total") for e in engines)
    queries = sum(scrape(e.url, "vllm:prefix_cache_queries_total") for e in engines)
    return hits, queries


def _run(urls_for: Any, workload: list[tuple[int, str]], concurrency: int = 4) -> None:
    """Sends each prompt (max_tokens=1) to `urls_for(family)`, `concurrency` at a time."""

    async def go() -> None:
        queue = list(workload)
        async with httpx.AsyncClient(timeout=60) as client:

            async def worker() -> None:
                while queue:
                    family, prompt = queue.pop(0)
                    body = {"model": NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
                    r = await client.post(f"{urls_for(family)}/v1/completions", json=body)
                    r.raise_for_status()

            await asyncio.gather(*(worker() for _ in range(concurrency)))

    asyncio.run(go())


def _hit_rate(engines: list[Server], urls_for: Any, phase: str) -> float:
    hits0, queries0 = _counters(engines)
    _run(urls_for, _workload(phase))
    hits1, queries1 = _counters(engines)
    return (hits1 - hits0) / (queries1 - queries0)


def _via_router(
    engines: list[Server], policy: PolicyName, phase: str, index: Any = "events"
) -> float:
    config = RouterConfig(
        prefill_policy=policy, decode_policy=policy, health_interval=0.2, prefix_index=index
    )
    router = RouterServer([Endpoint(e.url, "both") for e in engines], config)
    router.start()
    try:
        router.wait_ready(available=len(engines))
        return _hit_rate(engines, lambda _: router.url, phase)
    finally:
        router.stop()


def test_prefix_aware_routing_nears_the_oracle_and_beats_round_robin(
    engines: list[Server],
) -> None:
    """Prefix-aware placement's hit rate on the exact index and on the approximate one is
    >= 0.9x the oracle's (measured: about 0.97x for both), >= 1.5x round-robin's, and closes at
    least three quarters of the gap between round-robin and the oracle. (Not a fixed 2x over
    round-robin: round-robin's luck moves with timing, and one CI run saw it at 0.49x the oracle,
    where even the oracle is only 2.05x it.)"""
    oracle = _hit_rate(engines, lambda family: engines[family % NUM_ENGINES].url, "oracle")
    round_robin = _via_router(engines, "round-robin", "round-robin")
    exact = _via_router(engines, "prefix-aware", "exact")
    approximate = _via_router(engines, "prefix-aware", "approximate", index="approximate")
    print(f"hit rates: oracle {oracle:.3f}, round-robin {round_robin:.3f}, "
          f"exact {exact:.3f}, approximate {approximate:.3f}")  # fmt: skip
    assert oracle > 0.5  # the workload really is cacheable
    assert exact >= 0.9 * oracle
    assert approximate >= 0.9 * oracle
    assert min(exact, approximate) >= 1.5 * round_robin
    assert min(exact, approximate) - round_robin >= 0.75 * (oracle - round_robin)
