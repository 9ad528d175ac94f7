"""What a CPU engine's matmuls can do here: torch's `linear` (MKL's `sgemm` in float32, oneDNN
unpacked in bfloat16: what `nn.Linear` calls) against oneDNN with the weight packed once
(`baton.engine.layers.cpu_linear`, what Baton's CPU engine and vLLM's CPU build call; marked
`*` where this CPU has no bfloat16 GEMM and the packed layer computes in float32), on
SmolLM2-135M's shapes (or the `small` benchmark model's), float32 and bfloat16, side by side in
one run. The offline throughput of a 135M model is mostly these (74% of op time in a profile).

    python bench/matmul.py [--threads 2] [--batch 1 32 256] [--shapes smollm2|small]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, for `baton`

from baton.engine.layers.cpu_linear import PackedLinear, compute_dtype  # noqa: E402

# (in, out) of the projections: fused q/k/v, o, fused gate/up, down, lm_head
SHAPES = {
    "smollm2": [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)],
    "small": [(256, 512), (256, 256), (256, 1376), (688, 256), (256, 2048)],
}


def seconds(fn: Callable[[], torch.Tensor], reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def gflops(m: int, k: int, n: int, dtype: torch.dtype) -> tuple[float, float | None]:
    """GFLOP/s of `nn.Linear` and of the packed layer (None where oneDNN cannot pack `dtype`,
    even widened)."""
    linear = torch.nn.Linear(k, n, bias=False).to(dtype)
    x = torch.randn(m, k).to(dtype)
    flop = 2 * m * k * n / 1e9
    with torch.inference_mode():
        dense = flop / seconds(lambda: linear(x))
        compute = compute_dtype(dtype)
        if compute is None:
            return dense, None
        packed = PackedLinear(linear.weight, linear.bias, compute)
        return dense, flop / seconds(lambda: packed(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"GFLOP/s of a linear layer, {args.threads} threads; packed = oneDNN, weight packed once")
    print(f"{'tokens':>6} {'in':>5} {'out':>6} {'f32':>7} {'f32 packed':>11} {'x':>6} "
          f"{'bf16':>7} {'bf16 packed':>12} {'x':>6}")  # fmt: skip
    for m in args.batch:
        for k, n in SHAPES[args.shapes]:
            row = f"{m:6d} {k:5d} {n:6d}"
            for dtype, width in ((torch.float32, 11), (torch.bfloat16, 12)):
                dense, packed = gflops(m, k, n, dtype)
                if packed is None:
                    row += f" {dense:7.1f} {'-':>{width}} {'-':>6}"
                    continue
                mark = "*" if compute_dtype(dtype) != dtype else ""
                row += f" {dense:7.1f} {mark + f'{packed:.1f}':>{width}} {packed / dense:5.2f}x"
            print(row)


if __name__ == "__main__":
    main()
