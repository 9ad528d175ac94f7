"""Router overhead: the latency `baton router` adds over calling an engine directly, and the
requests/s it carries, against a fast fake engine (no model: answers at once).

Three processes share the machine: the fake engine (tests/support/fake_engine.py), the router
(`baton router --engine URL`), and this client. The same streamed completions go once straight
to the engine and once through the router, at concurrency 1 and 64; a request's latency is from
sending it to its last byte. Added latency is the router's percentile minus the direct one.

Two routers run side by side: one as deployed (streams migratable: each engine event's token
ids kept, and taken out for the client) and one with `--migration-limit 0` (events passed on
untouched), so the cost of migration's bookkeeping is a ratio of the same run.

    python bench/router.py [--requests 2000] [--max-tokens 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(argv: list[str], url: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{argv[:4]} exited: {proc.stderr.read().decode() if proc.stderr else ''}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{argv[:4]} not ready")


async def _load(
    url: str, concurrency: int, requests: int, max_tokens: int
) -> tuple[list[float], float]:
    """Latencies (s) of `requests` streamed completions, `concurrency` at a time, and the
    wall time of the whole run."""
    body = {"model": "fake", "prompt": "The relay team passes the baton. " * 8,
            "max_tokens": max_tokens, "stream": True}  # fmt: skip
    latencies: list[float] = []
    # aiohttp rather than httpx here: httpx's pool costs O(connections) per request, which
    # at 64 connections would make the client, not the router, the thing measured.
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as client:
        remaining = requests

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                start = time.perf_counter()
                async with client.post(f"{url}/v1/completions", json=body) as r:
                    async for _ in r.content.iter_any():
                        pass
                    if r.status != 200:
                        raise RuntimeError(f"status {r.status}")
                latencies.append(time.perf_counter() - start)

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - began


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(
    url: str, concurrency: int, requests: int, max_tokens: int, pid: int
) -> dict[str, float]:
    asyncio.run(_load(url, concurrency, min(requests, 200), max_tokens))  # warm-up
    cpu = _cpu_seconds(pid)
    latencies, wall = asyncio.run(_load(url, concurrency, requests, max_tokens))
    ms = np.array(latencies) * 1000
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "requests_per_s": len(latencies) / wall,
        # CPU the serving process (engine, or router) spent per request: unlike latency,
        # this hardly depends on what else runs on the machine
        "cpu_ms_per_request": (_cpu_seconds(pid) - cpu) * 1000 / len(latencies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="per run at concurrency 64")
    parser.add_argument("--max-tokens", type=int, default=16, help="chunks per streamed answer")
    parser.add_argument("--policy", default="prefix-aware")
    parser.add_argument(
        "--itl",
        type=float,
        default=0.0,
        help="the fake engine's seconds between chunks (0: answers at once, saturating the CPUs)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()

    engine_port = _free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    engine = _start(
        [
            sys.executable,
            "-m",
            "tests.support.fake_engine",
            "--port",
            str(engine_port),
            "--itl",
            str(args.itl),
        ],
        engine_url,
    )
    routers = {}
    for name, limit in (("router", "3"), ("no-migration", "0")):
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        routers[name] = (url, _start(
            [sys.executable, "-m", "baton.cli", "--log-level", "WARNING", "router",
             "--host", "127.0.0.1", "--port", str(port), "--engine", engine_url,
             "--policy", args.policy, "--migration-limit", limit],
            url,
        ))  # fmt: skip
    results: dict[str, dict[str, float]] = {}
    try:
        for concurrency, requests in ((1, max(200, args.requests // 4)), (64, args.requests)):
            targets = [("direct", engine_url, engine.pid)]
            targets += [(name, url, proc.pid) for name, (url, proc) in routers.items()]
            for name, url, pid in targets:
                results[f"{name}@{concurrency}"] = _measure(
                    url, concurrency, requests, args.max_tokens, pid
                )
    finally:
        for proc in [p for _, p in routers.values()] + [engine]:
            proc.terminate()
            proc.wait(10)

    print(f"{'':16} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'CPU ms/req':>10}")
    for key, r in results.items():
        print(
            f"{key:16} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['requests_per_s']:8.0f} "
            f"{r['cpu_ms_per_request']:10.2f}"
        )
    summary: dict[str, float] = {}
    for c in (1, 64):
        d, v = results[f"direct@{c}"], results[f"router@{c}"]
        summary[f"added_p50_ms@{c}"] = v["p50_ms"] - d["p50_ms"]
        summary[f"added_p99_ms@{c}"] = v["p99_ms"] - d["p99_ms"]
        summary[f"p99_ratio@{c}"] = v["p99_ms"] / d["p99_ms"]
        summary[f"rps_ratio@{c}"] = v["requests_per_s"] / d["requests_per_s"]
        print(
            f"concurrency {c:2}: router adds {summary[f'added_p50_ms@{c}']:.2f} ms at p50, "
            f"{summary[f'added_p99_ms@{c}']:.2f} ms at p99 (p99 x{summary[f'p99_ratio@{c}']:.2f}); "
            f"requests/s x{summary[f'rps_ratio@{c}']:.2f} of direct"
        )
        on, off = v, results[f"no-migration@{c}"]
        summary[f"migration_cpu_ratio@{c}"] = on["cpu_ms_per_request"] / off["cpu_ms_per_request"]
        summary[f"migration_p99_ratio@{c}"] = on["p99_ms"] / off["p99_ms"]
        print(
            f"concurrency {c:2}: migration bookkeeping: router CPU per request "
            f"x{summary[f'migration_cpu_ratio@{c}']:.2f} ({on['cpu_ms_per_request']:.3f} vs "
            f"{off['cpu_ms_per_request']:.3f} ms with --migration-limit 0), p99 "
            f"x{summary[f'migration_p99_ratio@{c}']:.2f}"
        )
    router64 = results["router@64"]
    print(
        f"router requests/s at concurrency 64: {router64['requests_per_s']:.0f} "
        f"({router64['cpu_ms_per_request']:.2f} ms of router CPU per request: "
        f"{1000 / router64['cpu_ms_per_request']:.0f} requests/s per core)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
