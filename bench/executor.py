"""Per-step overhead of the multiprocess executor against the in-process one (tiny model).

Drives an `EngineCore` directly (no server) through decode steps of a fixed batch and times
`core.step()`, for: the in-process executor ("uni"); one worker process ("mp", tp 1: the same
computation, so the difference is the executor's own cost: pickling the `SchedulerOutput`,
publishing it, the worker's wake-up, the output's way back); and two tensor-parallel workers
("mp", tp 2, which adds gloo's collectives: one all-reduce per attention and MLP block and the
embedding, one all-gather of the logits). Prints the median ms per step of each, the ratio
mp/uni and the ms the executor adds per step; aim (issue 9): under 1 ms.

    python bench/executor.py [--batch 8] [--steps 200] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from baton.engine.config import EngineArgs  # noqa: E402
from baton.engine.core import EngineCore  # noqa: E402
from baton.engine.models.tiny import write_tiny_model  # noqa: E402
from baton.engine.protocol import EngineCoreRequest  # noqa: E402
from baton.engine.sampling_params import SamplingParams  # noqa: E402


def _start(core: EngineCore, batch: int) -> None:
    """Puts `batch` long greedy requests in, then prefills and warms up."""
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        core.add_request(EngineCoreRequest(f"r{i}", [5 + i, 6, 7, 8], params, time.time()))
    for _ in range(20):
        core.step()


def _step_ms(core: EngineCore, steps: int) -> float:
    """Median ms of `steps` decode steps."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _message_cost(core: EngineCore) -> tuple[int, float]:
    """Bytes and µs to pickle and unpickle one decode step's `SchedulerOutput`."""
    out = core.scheduler.schedule()
    data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        pickle.loads(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
    return len(data), (time.perf_counter() - start) / n * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = write_tiny_model(Path(tempfile.mkdtemp(prefix="baton-bench-")) / "tiny", "llama")
    configs = {"uni": ("uni", 1), "mp tp=1": ("mp", 1), "mp tp=2": ("mp", 2)}
    cores = {
        name: EngineCore(
            EngineArgs(
                model=str(model),
                max_model_len=2048,
                tensor_parallel_size=tp,
                distributed_executor_backend=backend,
            )
        )
        for name, (backend, tp) in configs.items()
    }
    results: dict[str, Any] = {}
    try:
        for core in cores.values():
            _start(core, args.batch)
        # Repeats take turns, so that load from elsewhere on the machine hits every executor.
        ms: dict[str, list[float]] = {name: [] for name in cores}
        for _ in range(args.repeats):
            for name, core in cores.items():
                ms[name].append(_step_ms(core, args.steps))
        results["message_bytes"], results["message_pickle_us"] = _message_cost(cores["uni"])
    finally:
        for core in cores.values():
            core.shutdown()
    for name in cores:
        results[name] = statistics.median(ms[name])
        repeats = ", ".join(f"{m:.3f}" for m in ms[name])
        print(f"{name:8s} {results[name]:7.3f} ms/step  (repeats: {repeats})")
    uni, mp1, mp2 = results["uni"], results["mp tp=1"], results["mp tp=2"]
    results["ratio_mp1_uni"] = mp1 / uni
    results["added_ms_per_step"] = mp1 - uni
    print(
        f"step message: {results['message_bytes']} bytes, "
        f"{results['message_pickle_us']:.1f} µs to pickle + unpickle"
    )
    print(
        f"multiprocess executor (tp 1) / in-process: {mp1 / uni:.2f}x, "
        f"{mp1 - uni:+.3f} ms per step (aim < 1 ms)"
    )
    print(
        f"tensor parallel 2 / in-process: {mp2 / uni:.2f}x, {mp2 - uni:+.3f} ms per step "
        "(executor + gloo collectives)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
