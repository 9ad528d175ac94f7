"""The C decode-attention kernel against its torch reference."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from baton.engine.ops import cpu_paged_attention as cpa

pytestmark = pytest.mark.skipif(
    not cpa.available(torch.float32, 8, 4, 32, 16), reason="no C compiler for the CPU kernel"
)


@pytest.fixture(autouse=True)
def _two_threads() -> Iterator[None]:
    """The kernel splits its work over torch's thread count; the suite runs on one thread
    (tests/conftest.py), these tests on two, so that the parallel loop is what they check."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (8, 4, 32, 16),
        (8, 8, 64, 16),
        (8, 2, 64, 8),
        (16, 2, 128, 16),
        (4, 2, 16, 32),
        (6, 3, 24, 4),
    ],
)
def test_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    """Random block tables, lengths on and off block boundaries, GQA ratios 1 to 8, several
    head sizes (specialised and generic code paths): same result as the torch reference."""
    g = torch.Generator().manual_seed(0)
    num_blocks, layers = 64, 3
    cache = torch.randn(num_blocks, layers, 2, block_size, num_kv_heads, head_dim, generator=g)
    seq_lens = torch.tensor(
        [1, block_size, block_size + 1, 5 * block_size - 3, 97], dtype=torch.int32
    )
    max_blocks = int(-(-int(seq_lens.max()) // block_size))
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in seq_lens])
    tables = tables.to(torch.int32)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    scale = head_dim**-0.5
    for layer in range(layers):
        got = cpa.paged_decode_attention(q, cache, layer, tables, seq_lens, scale)
        ref = cpa.paged_decode_attention_reference(q, cache, layer, tables, seq_lens, scale)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 64), (6, 3, 24)]
)
def test_a_bfloat16_cache_matches_the_reference(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """A bfloat16 cache (values widened to float32 as loaded) and a bfloat16 query: the result
    equals the float32 reference on the same bfloat16 values, rounded to bfloat16, with a
    sliding window and soft-capping too."""
    g = torch.Generator().manual_seed(3)
    block_size, num_blocks = 16, 48
    cache = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, generator=g)
    cache = cache.to(torch.bfloat16)
    seq_lens = torch.tensor([1, 16, 17, 100, 250], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:16] for _ in seq_lens])
    tables = tables.to(torch.int32)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(torch.bfloat16)
    starts = torch.tensor([0, 3, 0, 40, 200], dtype=torch.int32)
    for kwargs in ({}, {"starts": starts, "softcap": 30.0}):
        got = cpa.paged_decode_attention(q, cache, 1, tables, seq_lens, 0.125, **kwargs)
        ref = cpa.paged_decode_attention_reference(
            q.float(), cache, 1, tables, seq_lens, 0.125, **kwargs
        )
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, ref.to(torch.bfloat16), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(got.float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (8, 4, 32, 16),  # one item per request: all four KV heads
        (9, 3, 64, 16),  # SmolLM2's shape
        (48, 6, 16, 16),  # group 8: two KV heads an item, three items a request
        (20, 5, 24, 8),  # group 4, generic head size: items of 4 and 1 KV heads
        (20, 20, 16, 16),  # no grouping (MHA): items of 16 and 4 KV heads
    ],
)
def test_items_of_several_heads_match_the_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    """With enough requests for every thread (12 on two), an item carries a run of KV heads and
    reads their rows together, the last run of a request possibly shorter: same result as the
    reference, with and without a window and soft-capping, and with a scale so large that most
    of each softmax underflows to zero."""
    g = torch.Generator().manual_seed(5)
    num_blocks = 96
    cache = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, generator=g)
    cache = cache.to(dtype)
    seq_lens = torch.tensor(
        [1, 2, block_size, block_size + 1, 33, 40, 57, 64, 71, 80, 99, 3], dtype=torch.int32
    )
    max_blocks = int(-(-int(seq_lens.max()) // block_size))
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in seq_lens])
    tables = tables.to(torch.int32)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    starts = (seq_lens - 20).clamp(min=0).to(torch.int32)
    for scale, kwargs in (
        (head_dim**-0.5, {}),
        (head_dim**-0.5, {"starts": starts, "softcap": 5.0}),
        (8.0, {}),
    ):
        got = cpa.paged_decode_attention(q, cache, 1, tables, seq_lens, scale, **kwargs)
        ref = cpa.paged_decode_attention_reference(q, cache, 1, tables, seq_lens, scale, **kwargs)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_rejects_bad_arguments() -> None:
    """The launcher checks dtypes and shapes instead of reading out of bounds."""
    cache = torch.zeros(4, 1, 2, 16, 2, 32)
    q = torch.zeros(1, 4, 32)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        cpa.paged_decode_attention(q, cache, 0, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="float32 or bfloat16 kv_cache"):
        cpa.paged_decode_attention(q, cache.half(), 0, tables, lens, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        cpa.paged_decode_attention(torch.zeros(1, 4, 16), cache, 0, tables, lens, 1.0)
    with pytest.raises(ValueError, match="one row per query"):
        cpa.paged_decode_attention(q, cache, 0, tables, torch.ones(2, dtype=torch.int32), 1.0)


@pytest.mark.skipif(not cpa._cpu_levels(), reason="prebuilt kernels are x86-64 only")
def test_a_prebuilt_kernel_serves_where_there_is_no_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the image does: `--prebuild DIR` at build time, then a runtime without a compiler
    loads the highest level this CPU runs from $BATON_KERNEL_DIR, and it computes what the
    reference does; with no folder either, the torch path is used (not a crash)."""
    out = subprocess.run(
        [sys.executable, "-m", "baton.engine.ops.cpu_paged_attention", "--prebuild", str(tmp_path)],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    assert len(out.stdout.split()) == 3 and len(list(tmp_path.glob("*.so"))) == 3
    monkeypatch.setattr(cpa, "_compiler", lambda: None)
    monkeypatch.setenv(cpa.KERNEL_DIR_ENV, str(tmp_path))
    cpa._library.cache_clear()
    try:
        chosen = cpa._prebuilt()
        assert chosen is not None and chosen.name == f"{cpa._key(cpa._cpu_levels()[0])}.so"
        assert cpa.available(torch.float32, 8, 4, 32, 16)
        g = torch.Generator().manual_seed(1)
        cache = torch.randn(8, 1, 2, 16, 4, 32, generator=g)
        tables = torch.tensor([[3, 1], [0, 7]], dtype=torch.int32)
        seq_lens = torch.tensor([20, 9], dtype=torch.int32)
        q = torch.randn(2, 8, 32, generator=g)
        got = cpa.paged_decode_attention(q, cache, 0, tables, seq_lens, 32**-0.5)
        ref = cpa.paged_decode_attention_reference(q, cache, 0, tables, seq_lens, 32**-0.5)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
        monkeypatch.setenv(cpa.KERNEL_DIR_ENV, str(tmp_path / "none"))
        cpa._library.cache_clear()
        assert not cpa.available(torch.float32, 8, 4, 32, 16)
    finally:
        cpa._library.cache_clear()
