"""KV blocks a request holds with sliding-window attention, against the same model with full
attention, at a context of 8 windows.

Two tiny random Mistral models, identical but for `sliding_window` (`--window` tokens, or none),
run the same requests (prompts of 8 windows minus the output, `--max-tokens` greedy tokens) through
the offline `LLM`; a spy on the KV cache manager records how many blocks each request holds after
every allocation. Printed: the blocks per request at the end (context = 8 windows) for each
model, and their ratio. Usage: `python bench/sliding_window_kv.py [--window 128] [--requests 4]`.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from baton import LLM, SamplingParams
from baton.engine.models.tiny import write_tiny_model


def held_blocks(
    path: Path, prompts: list[list[int]], max_tokens: int, block_size: int
) -> dict[str, Any]:
    """Runs the prompts; returns the most blocks any request held, and those held at the end."""
    context = len(prompts[0]) + max_tokens
    llm = LLM(str(path), max_model_len=context + block_size, block_size=block_size)
    kv = llm.engine.scheduler.kv
    last: dict[str, int] = {}
    peak = 0
    allocate = kv.allocate_slots

    def spy(request: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal peak
        result = allocate(request, *args, **kwargs)
        n = kv.num_held_blocks(request.request_id)
        last[request.request_id] = n
        peak = max(peak, n)
        return result

    kv.allocate_slots = spy  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - start
    llm.shutdown()
    return {"end": sum(last.values()) / len(last), "peak": peak, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--windows", type=int, default=8, help="context length in windows")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    context = args.windows * args.window
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, 512) for _ in range(context - args.max_tokens)]
        for _ in range(args.requests)
    ]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, window in (("sliding", args.window), ("full", None)):
            path = write_tiny_model(Path(tmp) / name, "mistral", sliding_window=window)
            results[name] = held_blocks(path, prompts, args.max_tokens, args.block_size)
    print(
        f"tiny mistral, {args.requests} requests, context {context} tokens = {args.windows} "
        f"windows of {args.window}, blocks of {args.block_size} tokens"
    )
    for name, r in results.items():
        print(
            f"  {name:8s} blocks held per request at the end: {r['end']:6.1f}  "
            f"(peak {r['peak']}, run {r['seconds']:.1f} s)"
        )
    ratio = results["full"]["end"] / results["sliding"]["end"]
    print(f"  full / sliding: {ratio:.2f}x fewer blocks with the window")


if __name__ == "__main__":
    main()
