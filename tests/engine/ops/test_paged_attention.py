"""paged_attention: the Triton kernels against the torch reference, the reference against SDPA."""

import importlib.util
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from baton.engine.ops.paged_attention import (
    _launch_config,
    _paged_attention_kernel,
    _paged_attention_reduce_kernel,
    choose_num_splits,
    paged_attention,
    paged_attention_reference,
)
from baton.engine.ops.reshape_and_cache import reshape_and_cache

# Garbage in unused block-table entries: reading one would fault or show up in the output.
_UNUSED_BLOCK = 1 << 20


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor  # [batch + 1] int32
    seq_lens: torch.Tensor  # [batch] int32
    block_tables: torch.Tensor  # [batch, max_blocks_per_seq] int32
    layer: int = 1
    scale: float = 0.0

    def run(self, fn: Callable[..., torch.Tensor] = paged_attention, **kwargs: Any) -> torch.Tensor:
        return fn(
            self.query,
            self.kv_cache,
            self.layer,
            self.query_start_loc,
            self.seq_lens,
            self.block_tables,
            self.scale,
            **kwargs,
        )


def _make_batch(
    device: torch.device,
    requests: list[tuple[int, int]],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    padding_tokens: int = 0,
) -> Batch:
    """Random query and cache for (q_len, seq_len) requests; blocks shuffled, garbage past them."""
    blocks_per_request = [math.ceil(seq_len / block_size) for _, seq_len in requests]
    num_blocks = sum(blocks_per_request) + 2
    kv_cache = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, device=device)
    block_ids = torch.randperm(num_blocks, device=device).int()
    # A column slice of a wider table: its row stride is not its row length.
    width = max(blocks_per_request) + 1
    block_tables = torch.full(
        (len(requests), width + 2), _UNUSED_BLOCK, dtype=torch.int32, device=device
    )[:, :width]
    used = 0
    for b, n in enumerate(blocks_per_request):
        block_tables[b, :n] = block_ids[used : used + n]
        used += n
    q_lens = torch.tensor([q_len for q_len, _ in requests])
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int32)
    query_start_loc[1:] = q_lens.cumsum(0)
    num_tokens = int(query_start_loc[-1]) + padding_tokens
    return Batch(
        query=torch.randn(num_tokens, num_heads, head_dim, device=device).to(dtype),
        kv_cache=kv_cache.to(dtype),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor([s for _, s in requests], dtype=torch.int32, device=device),
        block_tables=block_tables,
        scale=head_dim**-0.5,
    )


def _assert_matches_reference(batch: Batch, atol: float = 2e-5, **kwargs: int) -> None:
    expected = batch.run(paged_attention_reference)
    torch.testing.assert_close(batch.run(paged_attention, **kwargs), expected, atol=atol, rtol=atol)


def test_reference_matches_sdpa() -> None:
    """The reference (the other tests' oracle) equals SDPA on contiguous K/V, causal with offset."""
    # Prompt, decode, prefix-cache hit, chunk: q_len <= seq_len, rows end at seq_len - 1.
    requests = [(6, 6), (1, 11), (3, 9), (4, 13)]
    batch = _make_batch(torch.device("cpu"), requests, num_heads=8, num_kv_heads=2)
    out = batch.run(paged_attention_reference)
    block_size = batch.kv_cache.shape[3]
    for b, (q_len, seq_len) in enumerate(requests):
        blocks = batch.block_tables[b, : math.ceil(seq_len / block_size)].long()
        kv = batch.kv_cache[blocks, batch.layer].transpose(0, 1).flatten(1, 2)[:, :seq_len]
        start = int(batch.query_start_loc[b])
        q = batch.query[start : start + q_len].transpose(0, 1)  # [num_heads, q_len, head_dim]
        mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
        expected = F.scaled_dot_product_attention(
            q,
            kv[0].transpose(0, 1).repeat_interleave(4, dim=0),
            kv[1].transpose(0, 1).repeat_interleave(4, dim=0),
            attn_mask=mask,
            scale=batch.scale,
        )
        torch.testing.assert_close(out[start : start + q_len], expected.transpose(0, 1))


@pytest.mark.parametrize("num_queries_per_kv", [1, 4, 8])
def test_decodes_across_block_boundaries(device: torch.device, num_queries_per_kv: int) -> None:
    """Decodes whose contexts end just before, on and after block edges, for GQA ratios 1, 4, 8."""
    requests = [(1, n) for n in (1, 3, 4, 5, 8, 13)]
    batch = _make_batch(device, requests, num_heads=2 * num_queries_per_kv, num_kv_heads=2)
    _assert_matches_reference(batch, num_splits=1)


@pytest.mark.parametrize(("head_dim", "num_heads"), [(16, 4), (64, 4), (128, 8), (80, 6)])
def test_head_dims(device: torch.device, head_dim: int, num_heads: int) -> None:
    """head_dim 16/64/128 and a masked non-power-of-two 80 (with a group of 3 query heads)."""
    batch = _make_batch(device, [(5, 5), (1, 9), (3, 7)], num_heads=num_heads, head_dim=head_dim)
    _assert_matches_reference(batch)


def test_prompts_not_multiple_of_block(device: torch.device) -> None:
    """Whole prompts of lengths that end mid-block, longer than one query tile, are causal."""
    batch = _make_batch(device, [(5, 5), (17, 17), (70, 70)], num_heads=8, block_size=8)
    _assert_matches_reference(batch)


@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_mixed_batch(device: torch.device, num_splits: int) -> None:
    """Prompts, decodes, a prefix-cache hit and a chunked prefill in one launch, split or not."""
    # (20, 133) and (16, 72) have query tiles straddling a 64-key tile edge, so with splits some
    # rows see no key at all in a split: the kernel must keep those rows NaN-free.
    requests = [(9, 9), (1, 200), (20, 133), (1, 3), (16, 72), (1, 1)]
    batch = _make_batch(device, requests, num_heads=8, num_kv_heads=2)
    _assert_matches_reference(batch, num_splits=num_splits)


def test_long_decodes_take_split_path(device: torch.device) -> None:
    """A few long decodes get several splits by default, and the merged result is right."""
    batch = _make_batch(device, [(1, 1000), (1, 517)], num_heads=4, num_kv_heads=1, block_size=16)
    num_sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )
    assert choose_num_splits(2, 1, 1000, num_sms) > 1
    _assert_matches_reference(batch)


def test_padding_rows_untouched(device: torch.device) -> None:
    """Rows past query_start_loc[-1] keep their contents, with and without the merge kernel."""
    batch = _make_batch(device, [(3, 6), (1, 9)], padding_tokens=3)
    expected = batch.run(paged_attention_reference, out=torch.zeros_like(batch.query))
    for num_splits in (1, 2):
        out = torch.full_like(batch.query, float("nan"))
        batch.run(out=out, num_splits=num_splits)
        torch.testing.assert_close(out[:4], expected[:4], atol=2e-5, rtol=2e-5)
        assert out[4:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(device: torch.device, dtype: torch.dtype) -> None:
    """fp16/bf16 inputs give a same-dtype output close to the fp32-softmax reference."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("tl.dot on bf16 is wrong in Triton's CPU interpreter")
    batch = _make_batch(device, [(7, 7), (1, 300), (4, 12)], num_heads=8, dtype=dtype)
    for num_splits in (1, 2):
        out = batch.run(num_splits=num_splits)
        assert out.dtype == dtype
        expected = batch.run(paged_attention_reference)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_attends_to_what_reshape_and_cache_wrote(device: torch.device) -> None:
    """A prompt step then a decode step, K/V written by the cache kernel, equal dense SDPA."""
    num_heads, num_kv_heads, head_dim, block_size, prompt_len = 4, 2, 16, 4, 7
    kv_cache = torch.zeros(3, 1, 2, block_size, num_kv_heads, head_dim, device=device)
    block_table = torch.tensor([[2, 0]], dtype=torch.int32, device=device)
    q = torch.randn(prompt_len + 1, num_heads, head_dim, device=device)
    k = torch.randn(prompt_len + 1, num_kv_heads, head_dim, device=device)
    v = torch.randn(prompt_len + 1, num_kv_heads, head_dim, device=device)
    positions = torch.arange(prompt_len + 1, device=device)
    slots = block_table[0].long()[positions // block_size] * block_size + positions % block_size

    def step(first: int, last: int) -> torch.Tensor:
        reshape_and_cache(k[first:last], v[first:last], kv_cache, 0, slots[first:last])
        return paged_attention(
            q[first:last],
            kv_cache,
            0,
            torch.tensor([0, last - first], dtype=torch.int32, device=device),
            torch.tensor([last], dtype=torch.int32, device=device),
            block_table,
            head_dim**-0.5,
        )

    out = torch.cat([step(0, prompt_len), step(prompt_len, prompt_len + 1)])
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1).repeat_interleave(2, dim=0),
        v.transpose(0, 1).repeat_interleave(2, dim=0),
        is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_empty_batch(device: torch.device) -> None:
    """No requests: nothing launches and ``out`` comes back as given."""
    kv_cache = torch.zeros(1, 1, 2, 4, 1, 16, device=device)
    query = torch.zeros(0, 2, 16, device=device)
    no_ints = torch.zeros(0, dtype=torch.int32, device=device)
    out = paged_attention(
        query,
        kv_cache,
        0,
        torch.zeros(1, dtype=torch.int32, device=device),
        no_ints,
        no_ints.view(0, 1),
        1.0,
    )
    assert out.shape == (0, 2, 16)


def test_compiles_for_hopper(compile_for_hopper: Callable[[list[dict[str, Any]]], None]) -> None:
    """The launcher's decode, prefill and split variants compile for sm_90, not just interpret."""
    stats = {"partial_out_ptr": "fp32", "partial_max_ptr": "fp32", "partial_sum_ptr": "fp32"}
    jobs = []
    for dtype, num_queries_per_kv, max_query_len, num_splits in [
        ("fp16", 8, 1, 16),
        ("bf16", 4, 512, 1),
        ("fp32", 1, 1, 1),
    ]:
        config = _launch_config(num_queries_per_kv, 128, max_query_len)
        jobs.append(
            {
                "module": _paged_attention_kernel.__module__,
                "kernel": _paged_attention_kernel.__name__,
                "pointers": {"query_ptr": dtype, "kv_cache_ptr": dtype, "out_ptr": dtype}
                | stats
                | {"query_start_loc_ptr": "i32", "seq_lens_ptr": "i32", "block_tables_ptr": "i32"},
                "constexprs": {
                    "NUM_QUERIES_PER_KV": num_queries_per_kv,
                    "BLOCK_SIZE": 16,
                    "BLOCK_M": config.block_m,
                    "BLOCK_Q": config.block_m // num_queries_per_kv,
                    "TILE_N": config.tile_n,
                    "HEAD_DIM_PADDED": config.head_dim_padded,
                    "NUM_SPLITS": num_splits,
                    "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
                },
                "num_warps": config.num_warps,
            }
        )
    jobs.append(
        {
            "module": _paged_attention_reduce_kernel.__module__,
            "kernel": _paged_attention_reduce_kernel.__name__,
            "pointers": {"out_ptr": "bf16", "query_start_loc_ptr": "i32"} | stats,
            "constexprs": {"NUM_SPLITS": 16, "SPLITS_PADDED": 16, "HEAD_DIM_PADDED": 128},
            "num_warps": 4,
        }
    )
    compile_for_hopper(jobs)


def test_choose_num_splits() -> None:
    """Splits only when few programs meet a long context; powers of two, capped."""
    assert choose_num_splits(256, 8, 32768, 132) == 1  # a big batch fills the GPU alone
    assert choose_num_splits(1, 8, 200, 132) == 1  # too short to be worth a merge
    assert choose_num_splits(1, 8, 4096, 132) == 16  # capped by 4096 // 256 keys per split
    assert choose_num_splits(1, 8, 32768, 132) == 64  # 528 programs wanted / 8, capped at 64
    assert choose_num_splits(32, 8, 32768, 132) == 2
    for num_q_blocks in range(1, 40):
        n = choose_num_splits(num_q_blocks, 4, 10_000, 132)
        assert n & (n - 1) == 0


def _valid_args() -> dict[str, object]:
    return {
        "query": torch.zeros(3, 4, 16),
        "kv_cache": torch.zeros(4, 2, 2, 4, 2, 16),
        "layer": 1,
        "query_start_loc": torch.tensor([0, 2, 3], dtype=torch.int32),
        "seq_lens": torch.tensor([2, 5], dtype=torch.int32),
        "block_tables": torch.zeros(2, 2, dtype=torch.int32),
        "scale": 0.25,
    }


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"query": torch.zeros(3, 3, 16)}, "not a multiple of num_kv_heads"),
        ({"query": torch.zeros(3, 4, 32)}, "query must be"),
        ({"query": torch.zeros(3, 16, 4).transpose(1, 2)}, "contiguous in head_dim"),
        ({"query": torch.zeros(3, 4, 16, dtype=torch.float16)}, "differs from query dtype"),
        ({"kv_cache": torch.zeros(4, 2, 4, 2, 16)}, "kv_cache must be"),
        ({"layer": 2}, "layer 2 out of range"),
        ({"seq_lens": torch.tensor([2, 5])}, "seq_lens must be a 1-d int32"),
        ({"query_start_loc": torch.tensor([0, 3], dtype=torch.int32)}, "batch \\+ 1"),
        ({"block_tables": torch.zeros(3, 2, dtype=torch.int32)}, "block_tables must be"),
        ({"out": torch.zeros(3, 4, 8)}, "out must match query"),
    ],
)
def test_rejects_bad_inputs(change: dict[str, object], match: str) -> None:
    """Inconsistent shapes, dtypes and strides raise ValueError naming the problem."""
    args = _valid_args() | change
    for fn in (paged_attention, paged_attention_reference):
        with pytest.raises(ValueError, match=match):
            fn(**args)  # type: ignore[arg-type]


def test_reference_rejects_inconsistent_lengths() -> None:
    """The reference catches what the kernel cannot check: q_len > seq_len, too few blocks."""
    args = _valid_args()
    with pytest.raises(ValueError, match="q_len"):
        paged_attention_reference(**(args | {"seq_lens": torch.tensor([1, 5], dtype=torch.int32)}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs 3 blocks"):
        paged_attention_reference(**(args | {"seq_lens": torch.tensor([2, 9], dtype=torch.int32)}))  # type: ignore[arg-type]


def test_works_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without triton the module imports, the reference runs, and launching says what is missing."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.find_spec("baton.engine.ops.paged_attention")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.paged_attention_reference(**_valid_args())
    with pytest.raises(RuntimeError, match="needs triton"):
        module.paged_attention(**_valid_args())
