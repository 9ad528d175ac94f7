"""What a CPU engine's matmuls can do here: torch's `linear` (the GEMM Baton and vLLM's CPU
build both call) on SmolLM2-135M's shapes, float32 against bfloat16, side by side in one run.
The offline throughput of a 135M model is mostly these (74% of op time in a profile), so this
is the ceiling engine-side work cannot raise.

    python bench/matmul.py [--threads 2] [--batch 32 256]
"""

from __future__ import annotations

import argparse
import time

import torch

# (in, out) of SmolLM2-135M's projections: fused q/k/v, o, fused gate/up, down, lm_head
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]


def gflops(m: int, k: int, n: int, dtype: torch.dtype, reps: int = 20) -> float:
    a, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    for _ in range(3):
        torch.nn.functional.linear(a, w)
    start = time.perf_counter()
    for _ in range(reps):
        torch.nn.functional.linear(a, w)
    return 2 * m * k * n * reps / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"GFLOP/s of linear, {args.threads} threads")
    print(f"{'tokens':>6} {'in':>5} {'out':>6} {'float32':>8} {'bfloat16':>9} {'bf16/f32':>9}")
    for m in args.batch:
        for k, n in SHAPES:
            f32, bf16 = gflops(m, k, n, torch.float32), gflops(m, k, n, torch.bfloat16)
            print(f"{m:6d} {k:5d} {n:6d} {f32:8.1f} {bf16:9.1f} {bf16 / f32:8.2f}x")


if __name__ == "__main__":
    main()
