"""Sliding windows and score soft-capping in the attention kernels (C decode kernel, Triton
kernels under the interpreter) against their torch references and a dense computation."""

from __future__ import annotations

import math

import pytest
import torch

from baton.engine.ops import cpu_paged_attention as cpa
from baton.engine.ops.paged_attention import paged_attention, paged_attention_reference

# An id far past the cache: a kernel that reads a block behind the window faults or shows it.
_GONE = 1 << 20


def _dense(
    q: torch.Tensor,  # [q_len, heads, d]
    k: torch.Tensor,  # [seq_len, kv_heads, d]
    v: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Attention as transformers' eager path computes it, one position at a time."""
    q_len, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = torch.empty_like(q)
    for i in range(q_len):
        p = seq_len - q_len + i
        lo = 0 if window is None else max(0, p - window + 1)
        s = torch.einsum("hd,nhd->hn", q[i], k[lo : p + 1]) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v[lo : p + 1])
    return out


def _cache(
    seq_lens: list[int], block_size: int, kv_heads: int, head_dim: int, layers: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random cache and shuffled block tables, one row per sequence."""
    width = max(math.ceil(n / block_size) for n in seq_lens)
    num_blocks = width * len(seq_lens) + 3
    cache = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim)
    ids = torch.randperm(num_blocks)[: width * len(seq_lens)].view(len(seq_lens), width)
    return cache, ids.to(torch.int32).contiguous()


def _forget_behind(tables: torch.Tensor, first_keys: list[int], block_size: int) -> torch.Tensor:
    """The tables with every block wholly before each row's first key replaced by `_GONE`."""
    gone = tables.clone()
    for b, first in enumerate(first_keys):
        gone[b, : first // block_size] = _GONE
    return gone


@pytest.mark.skipif(
    not cpa.available(torch.float32, 8, 4, 32, 16), reason="no C compiler for the CPU kernel"
)
@pytest.mark.parametrize(("window", "softcap"), [(5, None), (16, None), (None, 2.0), (7, 3.0)])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"), [(8, 4, 32, 4), (4, 2, 16, 16)]
)
def test_c_decode_kernel(
    window: int | None,
    softcap: float | None,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    """The C kernel with a start position per sequence and soft-capping equals the reference
    and the dense computation, and never reads a block before the window."""
    seq_lens = [1, 3, block_size, block_size + 1, 37, 64]
    cache, tables = _cache(seq_lens, block_size, kv_heads, head_dim)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    starts = None
    first = [0] * len(seq_lens)
    if window is not None:
        first = [max(0, n - window) for n in seq_lens]
        starts = torch.tensor(first, dtype=torch.int32)
    q = torch.randn(len(seq_lens), heads, head_dim)
    scale = 0.3
    gone = _forget_behind(tables, first, block_size)
    for layer in range(2):
        got = cpa.paged_decode_attention(
            q, cache, layer, gone, lens, scale, starts=starts, softcap=softcap
        )
        ref = cpa.paged_decode_attention_reference(
            q, cache, layer, tables, lens, scale, starts=starts, softcap=softcap
        )
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
        for b, n in enumerate(seq_lens):
            blocks = tables[b, : math.ceil(n / block_size)].long()
            kv = cache[blocks, layer].transpose(0, 1).flatten(1, 2)[:, :n]
            dense = _dense(q[b : b + 1], kv[0], kv[1], scale, window, softcap)
            torch.testing.assert_close(got[b : b + 1], dense, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize(("window", "softcap"), [(6, None), (None, 2.0), (9, 1.5)])
def test_triton_kernel(
    device: torch.device, num_splits: int, window: int | None, softcap: float | None
) -> None:
    """The Triton kernel on a mixed batch (whole prompts longer than the window, a chunk after
    cached context, decodes) with a window and/or soft-capping equals the reference and the
    dense computation, split or not, and reads no block before a q-block's window."""
    block_size, heads, kv_heads, head_dim = 4, 4, 2, 32
    requests = [(20, 20), (5, 29), (1, 1), (1, 17), (1, 40)]  # (q_len, seq_len)
    seq_lens = [s for _, s in requests]
    cache, tables = _cache(seq_lens, block_size, kv_heads, head_dim)
    q_lens = [q for q, _ in requests]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), heads, head_dim)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    first = [max(0, s - q - (window or s) + 1) for q, s in requests]
    gone = _forget_behind(tables, first, block_size)
    scale = 0.25
    args = (1, qsl.to(device), lens.to(device))
    got = paged_attention(
        query.to(device),
        cache.to(device),
        *args,
        gone.to(device),
        scale,
        num_splits=num_splits,
        window=window,
        softcap=softcap,
    ).cpu()
    ref = paged_attention_reference(
        query, cache, 1, qsl, lens, tables, scale, window=window, softcap=softcap
    )
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    for b, (q_len, n) in enumerate(requests):
        blocks = tables[b, : math.ceil(n / block_size)].long()
        kv = cache[blocks, 1].transpose(0, 1).flatten(1, 2)[:, :n]
        rows = slice(int(qsl[b]), int(qsl[b]) + q_len)
        dense = _dense(query[rows], kv[0], kv[1], scale, window, softcap)
        torch.testing.assert_close(ref[rows], dense, atol=2e-5, rtol=1e-5)


def test_window_and_softcap_are_checked() -> None:
    """A window below 1 or a non-positive cap is refused with a message."""
    cache, tables = _cache([4], 4, 1, 16)
    args = (torch.randn(1, 1, 16), cache, 0, torch.tensor([0, 1], dtype=torch.int32))
    lens = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="window"):
        paged_attention_reference(*args, lens, tables, 1.0, window=0)
    with pytest.raises(ValueError, match="softcap"):
        paged_attention_reference(*args, lens, tables, 1.0, softcap=0.0)
