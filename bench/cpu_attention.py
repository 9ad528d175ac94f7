"""The C decode-attention kernel on a decode batch, against a baseline in the same run.

A batch of decoding requests (default 64, contexts of 150..650 tokens) on a paged cache whose
blocks are scattered over a cache four times the batch's size, as in a long-running engine, for
the `small` model's and SmolLM2-135M's attention shapes, float32 and bfloat16 caches. For each,
the kernel's time for one step (every layer), the K and V bytes it reads per second, and that
rate against a streaming read (`torch.sum` over a contiguous tensor of the same bytes: the
memory's rate for this access at its best). With `--against REV` the kernel source of git
revision REV is compiled too, and the two alternate in one loop: the printed ratio is REV's time
over this tree's. The cache is allocated as the engine's (`zeroed`: anonymous memory asking for
transparent huge pages); with `--huge-pages` a copy in 4 KiB pages is timed too, alternated, and
the printed ratio is its time over the huge pages'.

    python bench/cpu_attention.py [--against REV] [--huge-pages] [--repeats 9] [--batch 64]
        [--context 150 650]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch

from baton.engine.ops import cpu_paged_attention as cpa
from baton.engine.worker.model_runner import zeroed

ROOT = Path(__file__).resolve().parents[1]
# (name, query heads, KV heads, head_dim, layers)
SHAPES = [("small", 8, 4, 32, 4), ("smollm2", 9, 3, 64, 30)]
BLOCK = 16


def kernel_of(revision: str) -> ctypes.CDLL:
    """The kernel library built from `revision`'s source (compiled into the kernel cache)."""
    source = subprocess.run(
        ["git", "show", f"{revision}:baton/engine/ops/cpu_paged_attention.c"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cpu_paged_attention.c"
        path.write_bytes(source)
        before = cpa._SOURCE
        cpa._SOURCE = path
        cpa._library.cache_clear()
        try:
            lib = cpa._library()
        finally:
            cpa._SOURCE = before
            cpa._library.cache_clear()
    if lib is None:
        raise SystemExit(f"the kernel of {revision} did not compile")
    return lib


@contextlib.contextmanager
def calling(lib: ctypes.CDLL) -> Iterator[None]:
    """Makes `cpa.paged_decode_attention` call `lib` rather than this tree's kernel."""
    real = cpa._library
    cpa._library = lambda: lib  # type: ignore[assignment]
    try:
        yield
    finally:
        cpa._library = real


def make_batch(
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    layers: int,
    batch: int,
    context: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(*context, (batch,), generator=g, dtype=torch.int32)
    per_request = [-(-int(n) // BLOCK) for n in lens]
    num_blocks = 4 * sum(per_request)
    data = torch.randn(num_blocks, layers, 2, BLOCK, kv_heads, head_dim, generator=g)
    cache = zeroed(tuple(data.shape), dtype, torch.device("cpu"))  # as the engine's KV cache
    cache.copy_(data)
    scattered = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.zeros(batch, max(per_request), dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_request):
        tables[b, :n] = scattered[used : used + n]
        used += n
    q = torch.randn(batch, heads, head_dim, generator=g)
    return q, cache, tables, lens


def step(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> None:
    scale = q.shape[-1] ** -0.5
    for layer in range(cache.shape[1]):
        cpa.paged_decode_attention(q, cache, layer, tables, lens, scale)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", default=None, help="a git revision whose kernel to time too")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, nargs=2, default=(150, 650), metavar=("MIN", "MAX"))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--huge-pages",
        action="store_true",
        help="time the cache in 4 KiB pages too, alternated with the engine's (huge) ones",
    )
    args = parser.parse_args()
    if not cpa.available(torch.float32, 8, 4, 32, BLOCK):
        raise SystemExit("the CPU attention kernel is not available here (no C compiler?)")
    baseline = kernel_of(args.against) if args.against else None
    print(f"{torch.get_num_threads()} threads, {args.batch} requests, medians of {args.repeats}")
    for dtype in (torch.float32, torch.bfloat16):
        for name, heads, kv_heads, head_dim, layers in SHAPES:
            q, cache, tables, lens = make_batch(
                dtype, heads, kv_heads, head_dim, layers, args.batch, tuple(args.context)
            )
            read = int(lens.sum()) * layers * 2 * kv_heads * head_dim * cache.element_size()
            flat = torch.randn(read // 4)
            this, base, stream, small = [], [], [], []
            run = partial(step, q, cache, tables, lens)
            run()  # compiles and warms
            if baseline is not None:
                with calling(baseline):
                    run()
            if args.huge_pages:
                small_pages = zeroed(tuple(cache.shape), dtype, cache.device, huge_pages=False)
                run_small = partial(step, q, small_pages.copy_(cache), tables, lens)
                run_small()
            for _ in range(args.repeats):
                this.append(timed(run))
                stream.append(timed(flat.sum))
                if baseline is not None:
                    with calling(baseline):
                        base.append(timed(run))
                if args.huge_pages:
                    small.append(timed(run_small))
            t, s = statistics.median(this), statistics.median(stream)
            line = (
                f"{name:8} {str(dtype)[6:]:9} {t * 1e3:7.2f} ms/step  {read / t / 1e9:5.1f} GB/s"
                f"  x{s / t:.2f} of a streaming read ({read / s / 1e9:.1f} GB/s)"
            )
            if baseline is not None:
                b = statistics.median(base)
                line += f"  {args.against}: {b * 1e3:.2f} ms, x{b / t:.2f}"
            if args.huge_pages:
                b = statistics.median(small)
                line += f"  4 KiB pages: {b * 1e3:.2f} ms, x{b / t:.2f}"
            print(line)


if __name__ == "__main__":
    main()
