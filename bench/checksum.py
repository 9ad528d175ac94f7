"""What the KV block checksums cost per GB (``baton/kv_transfer/checksum.py``): xxh3 on the host
against sum64 on the host and, where CUDA is present, sum64 on the GPU against a device-to-device
copy of the same bytes, side by side in one run.

    python bench/checksum.py [--mib 256] [--block-kib 512] [--threads 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from baton.kv_transfer.checksum import SUM64, XXH3, block_crcs  # noqa: E402


def _gbps(fn: Callable[[], object], nbytes: int, sync: Callable[[], None], reps: int = 5) -> float:
    fn()  # warm: weights built, kernels loaded
    sync()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes checksummed per pass")
    parser.add_argument("--block-kib", type=int, default=512, help="bytes per KV block")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    blocks = args.mib * 1024 // args.block_kib
    kv = torch.randn(blocks, args.block_kib * 256)  # float32: 256 values a KiB
    ids = list(range(blocks))
    nbytes = kv.numel() * 4
    results = {
        "host xxh3": _gbps(lambda: block_crcs(kv, ids, XXH3), nbytes, lambda: None),
        "host sum64": _gbps(lambda: block_crcs(kv, ids, SUM64), nbytes, lambda: None),
    }
    if torch.cuda.is_available():
        gpu, dst = kv.cuda(), torch.empty_like(kv, device="cuda")
        sync = torch.cuda.synchronize
        results["gpu sum64"] = _gbps(lambda: block_crcs(gpu, ids, SUM64), nbytes, sync)
        results["gpu copy"] = _gbps(lambda: dst.copy_(gpu), nbytes, sync)
        results["gpu xxh3 (host copy)"] = _gbps(lambda: block_crcs(gpu, ids, XXH3), nbytes, sync)
    print(f"{args.mib} MiB in {blocks} blocks of {args.block_kib} KiB, {args.threads} thread(s)")
    for name, gbps in results.items():
        print(f"  {name:22s} {gbps:8.2f} GB/s   {1000 / gbps:8.2f} ms/GB")
    if "gpu sum64" in results:
        ratio = results["gpu sum64"] / results["gpu copy"]
        print(f"  gpu sum64 / device copy: {ratio:.2f}x the copy's rate")
    print(f"  host sum64 / host xxh3: {results['host sum64'] / results['host xxh3']:.3f}x")
    if args.json:
        args.json.write_text(json.dumps({"mib": args.mib, "gbps": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
