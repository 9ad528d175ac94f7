"""How the engine's step time grows with the number of running requests: decode steps of the
`small` benchmark model (or `--model`) at 1 to 1,024 requests, each request's context about 64
tokens, timed whole and split into the model's forward (the executor) and everything else (the
scheduler, sampling bookkeeping, outputs), in one run.

    python bench/step_time.py [--sizes 1 2 4 ... 1024] [--steps 10] [--json PATH] [--plot PNG]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])

from baton import LLM, SamplingParams  # noqa: E402
from baton.engine.models.tiny import default_model_path  # noqa: E402
from baton.engine.protocol import EngineCoreRequest  # noqa: E402

PROMPT_LEN = 48


def measure(llm: LLM, n: int, steps: int, rng: random.Random) -> dict[str, float]:
    """Mean wall time of one decode step with `n` running requests, and its model share."""
    core = llm.engine
    vocab = core.model_config.vocab_size
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    ids = [f"n{n}-{i}" for i in range(n)]
    for rid in ids:
        prompt = [rng.randrange(vocab) for _ in range(PROMPT_LEN)]
        core.add_request(EngineCoreRequest(rid, prompt, params, time.time(), 0))
    executor = core.executor
    model_s = [0.0]
    run = executor.execute_model

    def timed(out):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return run(out)
        finally:
            model_s[0] += time.perf_counter() - start

    executor.execute_model = timed  # type: ignore[method-assign]
    try:
        while len(core.scheduler.running) < n or any(
            r.num_computed_tokens < PROMPT_LEN for r in core.scheduler.running
        ):
            core.step()  # prompts, until every request decodes
        for _ in range(2):
            core.step()
        model_s[0] = 0.0
        start = time.perf_counter()
        for _ in range(steps):
            core.step()
        wall = (time.perf_counter() - start) / steps
    finally:
        executor.execute_model = run  # type: ignore[method-assign]
        core.abort_requests(ids)
        while core.has_unfinished_requests():
            core.step()
    model = model_s[0] / steps
    return {"running": n, "step_ms": wall * 1e3, "model_ms": model * 1e3,
            "other_ms": (wall - model) * 1e3, "us_per_request": wall / n * 1e6}  # fmt: skip


def plot(rows: list[dict[str, float]], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    n = [r["running"] for r in rows]
    ax.plot(n, [r["step_ms"] for r in rows], marker="o", label="whole step")
    ax.plot(n, [r["model_ms"] for r in rows], marker="o", label="model forward")
    ax.plot(n, [r["other_ms"] for r in rows], marker="o", label="scheduler and outputs")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("running requests (decoding)")
    ax.set_ylabel("ms per step")
    ax.set_title("Engine decode step time, 2 CPU cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the small model)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2**i for i in range(11)])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="draw the curve (needs matplotlib)")
    args = parser.parse_args()
    most = max(args.sizes)
    llm = LLM(
        args.model or str(default_model_path()),
        max_num_seqs=most,
        max_num_batched_tokens=max(8192, most * PROMPT_LEN),
        max_model_len=1024,
    )
    rng = random.Random(0)
    rows = [measure(llm, n, args.steps, rng) for n in args.sizes]
    print(f"decode step time, {torch.get_num_threads()} threads, {args.steps} steps per size")
    print(f"{'running':>8} {'step ms':>9} {'model ms':>9} {'other ms':>9} {'us/request':>11}")
    for r in rows:
        print(f"{r['running']:8d} {r['step_ms']:9.2f} {r['model_ms']:9.2f} "
              f"{r['other_ms']:9.2f} {r['us_per_request']:11.1f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
