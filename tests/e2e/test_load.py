"""Sustained load through the router over one prefill and one decode engine, with the `openai`
client: streaming requests sent at a steady rate (an open loop, so a slow server meets more
requests, not fewer). Every request must complete (a finish reason and `data: [DONE]`), and
the resident memory of every process after the run must stay within 10% of its value after
warm-up. Both runs are load, so both are in `make test-long`: 100 requests, and 2,000.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from tests.e2e.stacks import Stack, disagg_stack, save_figures

pytestmark = pytest.mark.slow

RATE = 16.0  # requests per second
MAX_TOKENS = 16
REQUEST_TIMEOUT = 60.0
MEMORY_BOUND = 1.10  # after the run / after warm-up, per process
SYSTEM = "You are a relay runner. The baton passes in a marked zone of twenty metres. "


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("load")
    # A CPU KV cache takes memory page by page as its blocks are first used, and the block pool
    # hands out never-used blocks first: a cache the warm-up cycles through whole (256 blocks)
    # keeps that first touch out of the leak check.
    flags = ("--max-model-len", "512", "--num-gpu-blocks-override", "256")
    with disagg_stack(tiny_model("llama"), tmp, *flags) as s:
        yield s


@dataclass
class Outcome:
    ok: bool
    seconds: float
    detail: str = ""


async def _one(client: openai.AsyncOpenAI, i: int) -> Outcome:
    """One streamed completion, read raw: its finish reason and the `[DONE]` line."""
    # a few shared system prompts (prefix-cache hits) and a unique tail per request
    prompt = f"{SYSTEM * (1 + i % 3)}Runner {i} takes the baton and"
    started = time.perf_counter()
    finish, done, text = None, False, []
    try:
        async with client.completions.with_streaming_response.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, stream=True
        ) as response:
            async for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    return Outcome(False, time.perf_counter() - started, f"error {chunk}")
                for choice in chunk["choices"]:
                    text.append(choice["text"])
                    finish = choice["finish_reason"] or finish
    except (openai.APIError, OSError, ValueError) as e:
        return Outcome(False, time.perf_counter() - started, f"{type(e).__name__}: {e}")
    seconds = time.perf_counter() - started
    if finish is None or not done:
        return Outcome(False, seconds, f"incomplete: finish={finish} done={done}")
    return Outcome(True, seconds)


async def _send(url: str, count: int, rate: float) -> list[Outcome]:
    """`count` streamed requests, the i-th sent at i / `rate` seconds; their outcomes."""
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT
    )
    async with client:
        start = time.monotonic()

        async def at(i: int) -> Outcome:
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            return await _one(client, i)

        return await asyncio.gather(*(at(i) for i in range(count)))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_load(stack: Stack, count: int, warm_up: int) -> dict[str, Any]:
    """Warm-up, memory, the run, memory again: the figures (asserted by the callers)."""
    warm = asyncio.run(_send(stack.url, warm_up, RATE))
    assert all(o.ok for o in warm), [o.detail for o in warm if not o.ok][:5]
    time.sleep(1)
    before = stack.rss()
    started = time.monotonic()
    outcomes = asyncio.run(_send(stack.url, count, RATE))
    wall = time.monotonic() - started
    time.sleep(1)
    after = stack.rss()
    latencies = [o.seconds for o in outcomes if o.ok]
    figures = {
        "requests": count,
        "rate_per_s": RATE,
        "max_tokens": MAX_TOKENS,
        "completed": len(latencies),
        "lost": [o.detail for o in outcomes if not o.ok][:20],
        "wall_s": round(wall, 1),
        "p50_ms": round(1000 * statistics.median(latencies), 1) if latencies else None,
        "p99_ms": round(1000 * _percentile(latencies, 0.99), 1) if latencies else None,
        "rss_mb": {n: [round(before[n] / 2**20, 1), round(after[n] / 2**20, 1)] for n in before},
    }
    print(f"\nload: {json.dumps(figures)}")
    save_figures(f"load-{count}", figures)
    assert not stack.dead(), stack.logs()
    assert figures["completed"] == count, (figures["lost"], stack.logs())
    return figures


# Load, not behaviour: the hand-off and streaming it drives are each checked in `make test`
# (tests/kv_transfer/test_disagg_servers.py, tests/test_serve.py); this adds volume only.
@pytest.mark.long
def test_load_short(stack: Stack) -> None:
    """100 streamed requests at a steady rate through the router: none lost, all complete."""
    run_load(stack, 100, warm_up=16)


@pytest.mark.long
def test_load_2000(stack: Stack) -> None:
    """2,000 streamed requests: none lost, all complete, each process's memory after the run
    within 10% of its value after warm-up."""
    figures = run_load(stack, 2000, warm_up=200)
    grown = {
        name: (was, now)
        for name, (was, now) in figures["rss_mb"].items()
        if now > was * MEMORY_BOUND
    }
    assert not grown, grown
