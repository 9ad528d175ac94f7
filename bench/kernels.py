"""Kernel benchmark (CUDA only): Baton's Triton paged attention against its hardware and SDPA.

Decode: achieved memory bandwidth (K/V read plus q/out, over time) as a fraction of the device's
peak, and time against torch ``scaled_dot_product_attention`` on already gathered, contiguous K/V
(the ideal dense baseline), at batch 1/32/256 and contexts 1k/4k/16k/32k. Prefill: TFLOP/s of
whole causal prompts against SDPA. Shapes: head_dim 128, 32 query heads, 8 KV heads, block size 16.

    python bench/kernels.py [--json out/kernels.json] [--peak-gbps 4800] [--dtypes fp16,bf16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.engine.ops.paged_attention import choose_num_splits, paged_attention
from baton.engine.ops.reshape_and_cache import reshape_and_cache

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Peak HBM bandwidth (GB/s) by device name, first match wins; other devices use a measured copy.
PEAK_GBPS = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("A100 80GB PCIe", 1935.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB", 2039.0),
)


def bench_ms(fn: Any) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50))


def measure_copy_gbps() -> float:
    """A large device-to-device copy: the practical peak (bytes read + written per second)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9


def table_peak_gbps(name: str) -> float | None:
    for pattern, gbps in PEAK_GBPS:
        if pattern in name:
            return gbps
    return None


def fits(num_bytes: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return num_bytes < 0.85 * free


def paged_inputs(
    q_lens: list[int], seq_lens: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """Random query and paged cache (one layer), each request's blocks shuffled over the cache."""
    blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks)
    kv_cache = torch.empty(
        num_blocks, 1, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda"
    ).normal_()
    ids = torch.randperm(num_blocks, device="cuda", dtype=torch.int64).int()
    block_tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(blocks):
        block_tables[b, :n] = ids[used : used + n]
        used += n
    query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    query = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    seq = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return query, kv_cache, query_start_loc.cuda(), seq, block_tables


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """SDPA with GQA; q [b, heads, q_len, d], k/v [b, kv_heads, s, d]."""
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    except TypeError:  # torch < 2.5: no enable_gqa
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def bench_decode(
    batch: int, context: int, dtype: torch.dtype, peak_gbps: float, num_sms: int
) -> dict[str, Any]:
    elem = torch.finfo(dtype).bits // 8
    kv_bytes = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * elem
    row: dict[str, Any] = {"dtype": str(dtype)[6:], "batch": batch, "context": context}
    if not fits(int(kv_bytes * 1.1)):
        row["skipped"] = "paged cache exceeds device memory"
        return row
    query, kv_cache, qsl, seq_lens, tables = paged_inputs([1] * batch, [context] * batch, dtype)
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5
    ms = bench_ms(
        lambda: paged_attention(query, kv_cache, 0, qsl, seq_lens, tables, scale, out, 1, context)
    )
    moved = kv_bytes + 2 * query.numel() * elem
    gbps = moved / (ms * 1e-3) / 1e9
    row |= {
        "num_splits": choose_num_splits(batch, NUM_KV_HEADS, context, num_sms),
        "us": ms * 1e3,
        "gbps": gbps,
        "fraction_of_peak": gbps / peak_gbps,
    }
    # Dense baseline: K/V already gathered per request into [batch, kv_heads, context, head_dim].
    if not fits(int(kv_bytes * 1.6)):  # the gathered K/V plus one temporary
        row["skipped"] = "no memory left for the SDPA baseline"
        return row
    blocks = tables[:, : context // BLOCK_SIZE].long()  # [batch, blocks]
    k, v = (
        kv_cache[blocks, 0, i]  # [batch, blocks, block_size, kv_heads, head_dim]
        .permute(0, 3, 1, 2, 4)
        .reshape(batch, NUM_KV_HEADS, context, HEAD_DIM)
        for i in (0, 1)
    )
    q = query.view(batch, NUM_HEADS, 1, HEAD_DIM)
    dense = sdpa(q, k, v, causal=False).view_as(out)
    sdpa_ms = bench_ms(lambda: sdpa(q, k, v, causal=False))
    row |= {
        "sdpa_us": sdpa_ms * 1e3,
        "speedup_vs_sdpa": sdpa_ms / ms,
        "max_abs_diff": float((dense.float() - out.float()).abs().max()),
    }
    return row


def bench_prefill(batch: int, prompt_len: int, dtype: torch.dtype) -> dict[str, Any]:
    query, kv_cache, qsl, seq_lens, tables = paged_inputs(
        [prompt_len] * batch, [prompt_len] * batch, dtype
    )
    k = torch.randn(batch * prompt_len, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    # Write the prompt's K/V the way the engine does, so the dense baseline sees the same values.
    positions = torch.arange(prompt_len, device="cuda")
    slots = (
        tables.long()[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    ).flatten()
    reshape_and_cache(k, v, kv_cache, 0, slots)
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5
    ms = bench_ms(
        lambda: paged_attention(
            query, kv_cache, 0, qsl, seq_lens, tables, scale, out, prompt_len, prompt_len
        )
    )
    flops = batch * 4 * NUM_HEADS * HEAD_DIM * prompt_len * (prompt_len + 1) / 2
    q = query.view(batch, prompt_len, NUM_HEADS, HEAD_DIM).transpose(1, 2)
    kd = k.view(batch, prompt_len, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    vd = v.view(batch, prompt_len, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    dense = sdpa(q, kd, vd, causal=True).transpose(1, 2).reshape_as(out)
    sdpa_ms = bench_ms(lambda: sdpa(q, kd, vd, causal=True))
    return {
        "dtype": str(dtype)[6:],
        "batch": batch,
        "prompt_len": prompt_len,
        "us": ms * 1e3,
        "tflops": flops / (ms * 1e-3) / 1e12,
        "sdpa_us": sdpa_ms * 1e3,
        "sdpa_tflops": flops / (sdpa_ms * 1e-3) / 1e12,
        "max_abs_diff": float((dense.float() - out.float()).abs().max()),
    }


def print_table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    print(f"\n{title}")
    print("  ".join(f"{c:>12}" for c in columns))
    for row in rows:
        cells = [row.get(c, "-") for c in columns]
        line = "  ".join(f"{c:>12.3f}" if isinstance(c, float) else f"{c!s:>12}" for c in cells)
        print(line + (f"  ({row['skipped']})" if "skipped" in row else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--peak-gbps", type=float, default=None, help="default: by device name")
    parser.add_argument("--dtypes", default="fp16,bf16", help="comma-separated: fp16,bf16")
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--contexts", default="1024,4096,16384,32768")
    parser.add_argument("--prompt-lens", default="512,2048,8192")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU; none is visible here.", file=sys.stderr)
        return 1
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench/kernels.py needs triton (pip install triton).", file=sys.stderr)
        return 1

    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    copy_gbps = measure_copy_gbps()
    torch.cuda.empty_cache()
    table_gbps = table_peak_gbps(name)
    if args.peak_gbps is not None:
        peak_gbps, peak_source = args.peak_gbps, "flag"
    elif table_gbps is not None:
        peak_gbps, peak_source = table_gbps, "table"
    else:
        peak_gbps, peak_source = copy_gbps, "measured copy"
    num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    print(f"device: {name}, {num_sms} SMs")
    print(f"peak {peak_gbps:.0f} GB/s ({peak_source}); measured D2D copy {copy_gbps:.0f} GB/s")

    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    decode = []
    for dtype in dtypes:
        for batch in (int(b) for b in args.batches.split(",")):
            for context in (int(c) for c in args.contexts.split(",")):
                decode.append(bench_decode(batch, context, dtype, peak_gbps, num_sms))
                torch.cuda.empty_cache()
    print_table(
        "decode (q_len 1)",
        decode,
        ["dtype", "batch", "context", "num_splits", "us", "gbps", "fraction_of_peak", "sdpa_us",
         "speedup_vs_sdpa", "max_abs_diff"],
    )  # fmt: skip
    prefill = []
    for dtype in dtypes:
        for prompt_len in (int(p) for p in args.prompt_lens.split(",")):
            prefill.append(bench_prefill(1, prompt_len, dtype))
            torch.cuda.empty_cache()
    print_table(
        "prefill (whole causal prompt, batch 1)",
        prefill,
        ["dtype", "prompt_len", "us", "tflops", "sdpa_us", "sdpa_tflops", "max_abs_diff"],
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "device": name,
            "peak_gbps": peak_gbps,
            "peak_source": peak_source,
            "copy_gbps": copy_gbps,
            "decode": decode,
            "prefill": prefill,
        }
        args.json.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
