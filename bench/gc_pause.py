"""How long a full garbage-collector pass stops a server (issue 23): the engine's API process
(its EngineCore started, the tiny test model) and the router, each built in a fresh process as
its server builds it, a full pass timed before and after `baton.http_server.freeze_startup_heap`,
side by side in one run.

A full pass stops the event loop, so every open stream waits it out; without the freeze, it
walks everything start-up made (the imports, the app, the tokenizer) each time it runs.

    python bench/gc_pause.py [--passes 5]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import subprocess
import sys
import time


def _full_pass_ms(passes: int) -> float:
    """The median time of `passes` full collections, in ms."""
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _measure(name: str, passes: int) -> None:
    from baton.http_server import freeze_startup_heap

    tracked = len(gc.get_objects())
    before = _full_pass_ms(passes)
    freeze_startup_heap()
    after = _full_pass_ms(passes)
    print(f"{name:<8} {tracked:>16,} {before:10.2f} {after:10.3f} {after / before:12.4f}")


async def _engine(passes: int, model: str) -> None:
    from baton.engine.api.server import ServerConfig, build_app
    from baton.engine.async_llm import AsyncLLM
    from baton.engine.config import EngineArgs

    llm = await AsyncLLM.start(EngineArgs(model=model))
    try:
        app = build_app(llm, ServerConfig())  # noqa: F841 (alive while measured)
        _measure("engine", passes)
    finally:
        await llm.shutdown()


def _router(passes: int) -> None:
    from baton.router.app import build_app
    from baton.router.config import RouterConfig
    from baton.router.router import Router

    app = build_app(Router(RouterConfig()))  # noqa: F841 (alive while measured)
    _measure("router", passes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=5, help="full passes timed, each side")
    parser.add_argument("--server", choices=("engine", "router"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.server == "engine":
        asyncio.run(_engine(args.passes, args.model))
        return 0
    if args.server == "router":
        _router(args.passes)
        return 0
    from baton.engine.models.tiny import default_model_path

    model = str(default_model_path())
    print(f"{'server':<8} {'tracked objects':>16} {'before ms':>10} {'after ms':>10} "
          f"{'after/before':>12}")  # fmt: skip
    for server in ("engine", "router"):
        command = [sys.executable, __file__, "--server", server, "--passes", str(args.passes)]
        subprocess.run([*command, "--model", model], check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
