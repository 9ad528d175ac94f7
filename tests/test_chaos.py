"""Chaos under sustained load (`make test-long`): `baton serve` with 1 prefill + 3 decode
engines of the tiny model carries a steady mix of streamed and whole completions and chats
while one random engine at a time is killed (SIGKILL, its process group) and restarted by
`baton serve`. No client sees an error, every greedy answer equals the single engine's, and
afterwards no engine holds a KV block, a lease or a request.

`BATON_CHAOS_SECONDS` sets the load's length (default 180); `BATON_RELIABILITY_RESULTS=folder`
keeps the figures for docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.e2e.stacks import save_figures
from tests.support.thread_server import scrape
from tests.test_migration import _kill, _up
from tests.test_serve import ENGINE_FLAGS, Serve, needs_roles

pytestmark = [pytest.mark.slow, pytest.mark.long, needs_roles]

SECONDS = float(os.environ.get("BATON_CHAOS_SECONDS", "180"))
CONCURRENCY = 6
ROUTES = ("/v1/completions", "/v1/chat/completions")
PROMPTS = [f"Runner {i} takes the baton on lap {i * 3} and" for i in range(6)]
# What an idle engine holds none of.
HELD = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "baton:kv_blocks_leased")  # fmt: skip


def _body(route: str, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 160, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    if route == "/v1/completions":
        return {**body, "prompt": prompt}
    return {**body, "messages": [{"role": "user", "content": prompt}]}


def _available(serve: Serve) -> bool:
    engines = serve.engines()
    return len(engines) == 4 and all(e["available"] and _up(e["url"]) for e in engines)


async def _ask(
    client: httpx.AsyncClient, url: str, route: str, body: dict[str, Any], stream: bool
) -> dict[str, Any]:
    """One request: its token ids, migrations, longest gap between chunks and duration; or
    the error the client saw."""
    start = time.monotonic()
    if not stream:
        r = await client.post(f"{url}{route}", json=body)
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {r.text[:300]}"}
        ids = r.json()["choices"][0]["token_ids"]
        return {"ids": ids, "migrations": 0, "gap": 0.0, "seconds": time.monotonic() - start}
    ids, migrations, gap, last = [], 0, 0.0, time.monotonic()
    async with client.stream("POST", f"{url}{route}", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread())[:300]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.monotonic()
            gap, last = max(gap, now - last), now
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": str(chunk["error"])}
            for choice in chunk["choices"]:
                ids += choice.get("token_ids") or []
            migrations = max(migrations, chunk.get("baton_migrations", 0))
    return {"ids": ids, "migrations": migrations, "gap": gap, "seconds": time.monotonic() - start}


def test_no_client_sees_an_engine_die(tiny_model: Any, tmp_path: Path) -> None:
    serve = Serve(
        tmp_path / "serve.log",
        "--model", str(tiny_model("llama")), "--served-model-name", "tiny",
        "--prefill", "1", "--decode", "3", "--policy", "round-robin",
        "--on-no-prefill", "decode", "--eject-seconds", "1", *ENGINE_FLAGS,
    )  # fmt: skip
    try:
        serve.wait_ready(180)
        decode = next(e["url"] for e in serve.engines() if e["role"] == "decode")
        reference = {}
        for route in ROUTES:
            for prompt in PROMPTS:
                r = httpx.post(f"{decode}{route}", json=_body(route, prompt), timeout=60)
                assert r.status_code == 200, r.text
                reference[route, prompt] = r.json()["choices"][0]["token_ids"]
        results, kills = asyncio.run(_load(serve, reference))
        figures = _check(serve, results, kills, reference)
        save_figures("chaos", figures)
    finally:
        assert serve.stop() == 0, serve.log()


async def _load(
    serve: Serve, reference: dict[tuple[str, str], list[int]]
) -> tuple[list[dict[str, Any]], list[str]]:
    rng = random.Random(22)
    deadline = time.monotonic() + SECONDS
    results: list[dict[str, Any]] = []
    kills: list[str] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            route, prompt = rng.choice(list(reference))
            stream = rng.random() < 0.75
            result = await _ask(client, serve.url, route, _body(route, prompt), stream)
            results.append({**result, "key": (route, prompt), "stream": stream})

    async def killer() -> None:
        while time.monotonic() < deadline - 5:
            while not await asyncio.to_thread(_available, serve):  # the last one is back
                await asyncio.sleep(0.5)
            await asyncio.sleep(rng.uniform(2, 4))
            victim = rng.choice(await asyncio.to_thread(serve.engines))
            await asyncio.to_thread(_kill, victim["url"])
            kills.append(victim["role"])

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(killer(), *(worker(client) for _ in range(CONCURRENCY)))
    return results, kills


def _check(
    serve: Serve,
    results: list[dict[str, Any]],
    kills: list[str],
    reference: dict[tuple[str, str], list[int]],
) -> dict[str, Any]:
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, f"{len(errors)} of {len(results)} requests failed: {errors[:5]}"
    wrong = [r["key"] for r in results if r["ids"] != reference[r["key"]]]
    assert not wrong, f"{len(wrong)} answers differ from the single engine's: {wrong[:3]}"
    assert kills, "no engine was killed"
    migrated = [r for r in results if r["migrations"]]
    calm = [r for r in results if r["stream"] and not r["migrations"]]
    # Leaks: with the load over and every engine back, none holds a request, block or lease.
    deadline = time.monotonic() + 60
    while not _available(serve) and time.monotonic() < deadline:
        time.sleep(0.5)
    held: dict[str, float] = {}
    for _ in range(40):
        held = {
            f"{e['url']} {name}": scrape(e["url"], name) for e in serve.engines() for name in HELD
        }
        if not any(held.values()):
            break
        time.sleep(0.5)
    assert not any(held.values()), held
    figures: dict[str, Any] = {
        "seconds": SECONDS,
        "requests": len(results),
        "streamed": sum(r["stream"] for r in results),
        "kills": len(kills),
        "kills_by_role": {role: kills.count(role) for role in set(kills)},
        "migrated_streams": len(migrated),
        "migrations": sum(r["migrations"] for r in migrated),
        "router_migrations": {
            o: scrape(serve.url, "baton:router_migrations_total", outcome=o)
            for o in ("resumed", "failed", "limit_reached")
        },
        "router_retries": scrape(serve.url, "baton:router_retries_total"),
        # A stream's longest wait between two chunks, and its length, with and without a
        # migration (the machine's load makes the calm ones' tail long too).
        **{
            name: {"calm": _percentiles(calm, key), "migrated": _percentiles(migrated, key)}
            for name, key in (("longest_gap_ms", "gap"), ("stream_ms", "seconds"))
        },
    }
    print(json.dumps(figures, indent=1))
    return figures


def _percentiles(results: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    """p50, p99 and max of `key` (seconds) over `results`, in milliseconds."""
    if not results:
        return None
    values = np.array([r[key] for r in results]) * 1000
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)),
            "max": float(values.max())}  # fmt: skip
