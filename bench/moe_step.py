"""Step cost of a mixture-of-experts model against the dense model of the same active size.

The MoE model is the random `mixtral` model of `baton.engine.models.tiny` (4 experts, top-2, each
expert half the dense MLP's width); the dense one is `mistral` of the same size: the same hidden
size, layers and attention, and an MLP as wide as the two experts a token runs
(intermediate = top_k * expert intermediate), so both do the same matmul FLOPs per token. Drives
an `EngineCore` in process (no server) and times `core.step()`: decode steps of a fixed batch, and
single-step prefills of fresh prompts (prefix caching off). Prints median ms per step of each model
and the MoE/dense ratio; the difference is the routing and grouping's own cost (and, for decode,
reading every expert a batch touches).

    python bench/moe_step.py [--size small] [--batch 8] [--steps 50] [--prompt-len 256]
        [--threads N] [--json out.json]

On a machine shared with other work, pass --threads 1: OpenMP threads that spin waiting for a
descheduled peer cost the MoE layer (more, smaller ops) far more than the dense MLP.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from baton.engine.config import EngineArgs  # noqa: E402
from baton.engine.core import EngineCore  # noqa: E402
from baton.engine.models.config import ModelConfig  # noqa: E402
from baton.engine.models.tiny import write_tiny_model  # noqa: E402
from baton.engine.protocol import EngineCoreRequest  # noqa: E402
from baton.engine.sampling_params import SamplingParams  # noqa: E402

_PARAMS = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _decode_ms(core: EngineCore, batch: int, steps: int, vocab: int) -> float:
    """Median ms of `steps` decode steps of `batch` requests (prefilled and warmed up first)."""
    rng = random.Random(0)
    for i in range(batch):
        prompt = _prompt(rng, 16, vocab)
        core.add_request(EngineCoreRequest(f"d{i}", prompt, _PARAMS, time.time()))
    for _ in range(10):
        core.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    core.abort_requests([f"d{i}" for i in range(batch)])
    return statistics.median(times) * 1e3


def _prefill_ms(core: EngineCore, prompt_len: int, repeats: int, vocab: int) -> float:
    """Median ms of a step that prefills one fresh `prompt_len`-token prompt."""
    rng = random.Random(1)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for i in range(repeats + 1):  # the first warms up
        prompt = _prompt(rng, prompt_len, vocab)
        core.add_request(EngineCoreRequest(f"p{i}", prompt, params, time.time()))
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
        while core.has_unfinished_requests():
            core.step()
    return statistics.median(times[1:]) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=("tiny", "small"), default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="rounds, taking turns")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="baton-bench-moe-"))
    paths = {
        "moe": write_tiny_model(root / "moe", "mixtral", args.size),
        "dense": write_tiny_model(root / "dense", "mistral", args.size),
    }
    moe_cfg = ModelConfig.from_pretrained(paths["moe"])
    dense_cfg = ModelConfig.from_pretrained(paths["dense"])
    active = moe_cfg.num_experts_per_tok * moe_cfg.moe_intermediate_size
    assert active == dense_cfg.intermediate_size, (active, dense_cfg.intermediate_size)
    print(
        f"moe: mixtral-{args.size}, {moe_cfg.num_experts} experts, "
        f"top-{moe_cfg.num_experts_per_tok}, expert intermediate {moe_cfg.moe_intermediate_size}; "
        f"dense: mistral-{args.size}, "
        f"intermediate {dense_cfg.intermediate_size}; hidden {moe_cfg.hidden_size}, "
        f"{moe_cfg.num_layers} layers; torch threads {torch.get_num_threads()}"
    )
    cores = {
        name: EngineCore(
            EngineArgs(
                model=str(path),
                max_model_len=max(1024, args.prompt_len + 64),
                enable_prefix_caching=False,
            )
        )
        for name, path in paths.items()
    }
    vocab = moe_cfg.vocab_size
    ms: dict[str, list[float]] = {f"{n} {k}": [] for n in cores for k in ("decode", "prefill")}
    try:
        for _ in range(args.repeats):  # rounds take turns: load from elsewhere hits both
            for name, core in cores.items():
                ms[f"{name} decode"].append(_decode_ms(core, args.batch, args.steps, vocab))
                ms[f"{name} prefill"].append(_prefill_ms(core, args.prompt_len, 5, vocab))
    finally:
        for core in cores.values():
            core.shutdown()
    results: dict[str, Any] = {key: statistics.median(v) for key, v in ms.items()}
    for kind, what in (("decode", f"batch {args.batch}"), ("prefill", f"{args.prompt_len} tokens")):
        moe, dense = results[f"moe {kind}"], results[f"dense {kind}"]
        results[f"ratio {kind}"] = moe / dense
        print(
            f"{kind:7s} ({what}): moe {moe:7.3f} ms/step, dense {dense:7.3f} ms/step, "
            f"moe/dense {moe / dense:.2f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
