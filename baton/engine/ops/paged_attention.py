"""Paged attention over a mixed batch of prompt chunks and decodes, in one launch (Triton + torch).

Queries are varlen: request ``b`` owns rows ``query_start_loc[b]:query_start_loc[b + 1]``, and the
paged cache ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` already holds this
step's K/V. Row ``i`` of a request with ``q_len`` rows sits at absolute position
``seq_lens[b] - q_len + i`` and attends to keys ``0..position``, which covers full prompts, chunked
prefill, prefix-cache hits and decodes (``q_len == 1``) alike. With a sliding ``window`` it attends
keys ``position - window + 1..position`` only, and blocks wholly before the first row's window are
never read (the KV cache manager may have given them back). With ``softcap`` each scaled score
``s`` becomes ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2).

Kernel design (after vLLM's unified Triton attention). A program owns one *q-block* (``BLOCK_Q``
query tokens of one request times the ``num_heads // num_kv_heads`` query heads sharing one KV head,
packed into ``BLOCK_M`` rows so a GQA decode still feeds ``tl.dot``), one KV head, and one split of
the q-block's key range. With one split it writes the output directly; with several
(flash-decoding, for a few long decodes that would otherwise leave most SMs idle) it writes
unnormalised partial results and a second small kernel merges them. The split count comes from
:func:`choose_num_splits`.

Triton is imported and the kernels jitted on first launch, not at import: the module imports
without triton (the reference still works), and ``TRITON_INTERPRET=1`` only has to be set before
the first launch, provided nothing else imported triton earlier.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch

from baton.engine.ops.launch import SUPPORTED_DTYPES, check_kv_cache, jit, next_power_of_2

# triton.language, bound by `launch.jit` on first launch (this module imports without triton).
tl: Any = None

__all__ = ["choose_num_splits", "paged_attention", "paged_attention_reference"]

_MAX_HEAD_DIM = 256
_LOG2_E = 1.4426950408889634

# Split heuristic. A decode program streams its keys once, so the GPU is only busy when there are
# several programs per SM; below that, split each key range further, but never into pieces so short
# that the partial-result traffic and the merge cost more than they save.
_PROGRAMS_PER_SM = 4
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 64
# The interpreter has no SMs; this nominal count makes the CPU tests exercise the split path.
_NOMINAL_SMS_WITHOUT_CUDA = 4


def _paged_attention_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    kv_cache_ptr,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim]; written when NUM_SPLITS == 1
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] fp32, unnormalised
    partial_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32, row max of log2-scaled scores
    partial_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32, softmax denominator
    query_start_loc_ptr,  # [batch + 1] int32
    seq_lens_ptr,  # [batch] int32
    block_tables_ptr,  # [batch, max_blocks_per_seq] int32
    batch,
    layer,
    num_heads,
    head_dim,
    qk_scale,  # softmax scale * log2(e): scores live in the log2 domain (exp2 is cheaper);
    # with SOFTCAP the softmax scale alone (the cap applies to natural-domain scores)
    softcap,
    window,  # read only with SLIDING
    stride_query_t,
    stride_query_h,
    stride_out_t,
    stride_out_h,
    stride_cache_block,
    stride_cache_layer,
    stride_cache_kv,
    stride_cache_slot,
    stride_cache_head,
    stride_block_tables,
    NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Request b's q-blocks are numbered from query_start_loc[b] // BLOCK_Q + b, which needs no
    # prefix sum over the batch (a request may get one spare q-block; it exits below). Binary
    # search for the last request whose first q-block is <= this one.
    lo: tl.int32 = 0
    hi = batch
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    req = lo - 1
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + req)
    if q_block_local * BLOCK_Q >= q_len:
        return
    context_start = tl.load(seq_lens_ptr + req) - q_len  # absolute position of the first row

    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M] packed (token, query head in group) rows
    offs_d = tl.arange(0, HEAD_DIM_PADDED)  # [HEAD_DIM_PADDED]
    token_local = q_block_local * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # [BLOCK_M]
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV  # [BLOCK_M]
    row_valid = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (token_local < q_len)  # [BLOCK_M]
    row_pos = context_start + token_local  # [BLOCK_M] absolute position of each row
    d_valid = offs_d < head_dim  # [HEAD_DIM_PADDED]
    token = (q_start + token_local).to(tl.int64)  # [BLOCK_M]

    q = tl.load(
        query_ptr
        + token[:, None] * stride_query_t
        + head[:, None] * stride_query_h
        + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PADDED]

    # Causal: the q-block needs keys up to its last row's position. Split that range evenly.
    kv_len = context_start + tl.minimum((q_block_local + 1) * BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_len, TILE_N)
    # With a window, keys before the first row's window are neither read nor split over.
    kv_first = 0
    if SLIDING:
        kv_first = tl.maximum(context_start + q_block_local * BLOCK_Q - window + 1, 0)
    first_tile = kv_first // TILE_N
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    tile_start = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # [BLOCK_M] running max
    l_i = tl.zeros([BLOCK_M], tl.float32)  # [BLOCK_M] running denominator
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)  # [BLOCK_M, HEAD_DIM_PADDED]

    cache_ptr = kv_cache_ptr + layer * stride_cache_layer + kv_head * stride_cache_head
    block_table_ptr = block_tables_ptr + req.to(tl.int64) * stride_block_tables
    for tile in range(tile_start, tile_end):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] key positions
        n_valid = (offs_n < kv_len) & (offs_n >= kv_first)  # [TILE_N]
        block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
        kv_offs = (
            block_ids.to(tl.int64) * stride_cache_block + (offs_n % BLOCK_SIZE) * stride_cache_slot
        )  # [TILE_N]
        k = tl.load(
            cache_ptr + kv_offs[None, :] + offs_d[:, None],
            mask=n_valid[None, :] & d_valid[:, None],
            other=0.0,
        )  # [HEAD_DIM_PADDED, TILE_N]
        v = tl.load(
            cache_ptr + stride_cache_kv + kv_offs[:, None] + offs_d[None, :],
            mask=n_valid[:, None] & d_valid[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_DIM_PADDED]

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        if SOFTCAP:
            # tanh from exp (stable for any sign): tanh(x) = sign(x) (1 - e^-2|x|) / (1 + e^-2|x|)
            x = s / softcap
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = softcap * tl.where(x < 0, -t, t) * 1.4426950408889634
        visible = (offs_n[None, :] <= row_pos[:, None]) & n_valid[None, :]
        if SLIDING:
            visible = visible & (offs_n[None, :] > row_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
        # A row may see no key yet (a later split, or a prompt row before this tile): keep its
        # max at -inf but shift by 0 so exp2 gives 0 rather than NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])  # [BLOCK_M, TILE_N]
        alpha = tl.exp2(m_i - m_shift)  # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr
            + token[:, None] * stride_out_t
            + head[:, None] * stride_out_h
            + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_valid[None, :],
        )
    else:
        stat = (token * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(partial_max_ptr + stat, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + stat, l_i, mask=row_valid)
        tl.store(
            partial_out_ptr + stat[:, None] * head_dim + offs_d[None, :],
            acc,
            mask=row_valid[:, None] & d_valid[None, :],
        )


def _paged_attention_reduce_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] fp32, unnormalised
    partial_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    partial_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    query_start_loc_ptr,  # [batch + 1] int32
    batch,
    num_heads,
    head_dim,
    stride_out_t,
    stride_out_h,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    # Rows past the last request are padding: no program wrote their partials.
    if token >= tl.load(query_start_loc_ptr + batch):
        return
    offs_s = tl.arange(0, SPLITS_PADDED)  # [SPLITS_PADDED]
    offs_d = tl.arange(0, HEAD_DIM_PADDED)  # [HEAD_DIM_PADDED]
    s_valid = offs_s < NUM_SPLITS
    d_valid = offs_d < head_dim
    stat = (token.to(tl.int64) * num_heads + head) * NUM_SPLITS + offs_s  # [SPLITS_PADDED]

    m = tl.load(partial_max_ptr + stat, mask=s_valid, other=float("-inf"))  # [SPLITS_PADDED]
    sums = tl.load(partial_sum_ptr + stat, mask=s_valid, other=0.0)  # [SPLITS_PADDED]
    # Every row sees its own key, in some split, so m_max is finite and empty splits
    # (m == -inf) get weight 0.
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - m_max)  # [SPLITS_PADDED]
    denom = tl.sum(weight * sums, 0)
    acc = tl.load(
        partial_out_ptr + stat[:, None] * head_dim + offs_d[None, :],
        mask=s_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [SPLITS_PADDED, HEAD_DIM_PADDED]
    out = tl.sum(acc * weight[:, None], 0) / denom  # [HEAD_DIM_PADDED]
    tl.store(
        out_ptr + token.to(tl.int64) * stride_out_t + head * stride_out_h + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_valid,
    )


def choose_num_splits(num_q_blocks: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many pieces to split each q-block's key range into (flash-decoding).

    ``num_q_blocks * num_kv_heads`` programs run without splitting. When that is below
    ``_PROGRAMS_PER_SM`` per SM, split so the GPU fills up, keeping every split at least
    ``_MIN_KEYS_PER_SPLIT`` keys of the longest sequence long. Returns a power of two (at most
    ``_MAX_SPLITS``) so few kernel variants get compiled; 1 means no split and no merge kernel.
    """
    programs = max(1, num_q_blocks * num_kv_heads)
    wanted = min(
        (num_sms * _PROGRAMS_PER_SM) // programs,
        max_seq_len // _MIN_KEYS_PER_SPLIT,
        _MAX_SPLITS,
    )
    if wanted < 2:
        return 1
    return 1 << (wanted.bit_length() - 1)


class _LaunchConfig(NamedTuple):
    block_m: int  # packed (query token, query head) rows per program
    tile_n: int  # keys per inner-loop step
    head_dim_padded: int
    num_warps: int


def _launch_config(num_queries_per_kv: int, head_dim: int, max_query_len: int) -> _LaunchConfig:
    """Tile shapes; chosen so the head_dim <= 128 variants compile for sm_90 without spilling.

    tl.dot needs at least 16 rows, which a GQA decode fills with its query heads. Prompt chunks
    get taller tiles (and more warps) so each K/V tile loaded serves more query rows.
    """
    head_dim_padded = max(16, next_power_of_2(head_dim))
    group = next_power_of_2(num_queries_per_kv)
    if max_query_len > 1:
        tile_n = 64 if head_dim_padded <= 128 else 16
        return _LaunchConfig(max(64, group), tile_n, head_dim_padded, num_warps=8)
    tile_n = 32 if head_dim_padded <= 128 else 16
    return _LaunchConfig(max(16, group), tile_n, head_dim_padded, num_warps=4)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return _NOMINAL_SMS_WITHOUT_CUDA


def _check_inputs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    check_kv_cache(kv_cache, layer)
    _, _, _, _, num_kv_heads, head_dim = kv_cache.shape
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(
            f"query must be [num_tokens, num_heads, head_dim={head_dim}], got {tuple(query.shape)}"
        )
    num_heads = query.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} exceeds the supported maximum {_MAX_HEAD_DIM}")
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"query dtype {query.dtype} not in {SUPPORTED_DTYPES}")
    if kv_cache.dtype != query.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} differs from query dtype {query.dtype}")
    batch = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    for name, t, ndim in (
        ("query_start_loc", query_start_loc, 1),
        ("seq_lens", seq_lens, 1),
        ("block_tables", block_tables, 2),
    ):
        if t.dim() != ndim or t.dtype != torch.int32:
            raise ValueError(
                f"{name} must be a {ndim}-d int32 tensor, got {t.dim()}-d {t.dtype} "
                f"with shape {tuple(t.shape)}"
            )
        if t.numel() > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got {t.stride()}")
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError(
            f"query_start_loc has {query_start_loc.shape[0]} entries, expected batch + 1 = "
            f"{batch + 1} (seq_lens has {batch})"
        )
    if block_tables.shape[0] != batch or (batch > 0 and block_tables.shape[1] == 0):
        raise ValueError(
            f"block_tables must be [batch={batch}, max_blocks_per_seq >= 1], "
            f"got {tuple(block_tables.shape)}"
        )
    tensors = {
        "query": query,
        "query_start_loc": query_start_loc,
        "seq_lens": seq_lens,
        "block_tables": block_tables,
    }
    if out is not None:
        tensors["out"] = out
    for name, t in tensors.items():
        if t.device != kv_cache.device:
            raise ValueError(f"{name} is on {t.device} but kv_cache is on {kv_cache.device}")
    if query.shape[0] > 0 and query.stride(2) != 1:
        raise ValueError(f"query must be contiguous in head_dim, got strides {query.stride()}")
    if out is not None:
        if out.shape != query.shape or out.dtype != query.dtype:
            raise ValueError(
                f"out must match query ({tuple(query.shape)}, {query.dtype}), "
                f"got ({tuple(out.shape)}, {out.dtype})"
            )
        if out.shape[0] > 0 and out.stride(2) != 1:
            raise ValueError(f"out must be contiguous in head_dim, got strides {out.stride()}")


def _check_window(window: int | None, softcap: float | None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    layer: int,
    query_start_loc: torch.Tensor,  # [batch + 1] int32
    seq_lens: torch.Tensor,  # [batch] int32, context length including this step's tokens
    block_tables: torch.Tensor,  # [batch, max_blocks_per_seq] int32
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    *,
    num_splits: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each request's query rows over its paged context; returns ``out``.

    ``max_query_len`` and ``max_seq_len`` are tuning hints (tile shape and split count); pass
    them to avoid a device sync, results do not depend on them. ``num_splits`` forces the
    flash-decoding split count (default: :func:`choose_num_splits`). Rows past
    ``query_start_loc[-1]`` (padding) are left untouched. Inputs are not checked against each
    other on device: ``query_start_loc`` must be non-decreasing, ``q_len <= seq_len`` and every
    block a request needs must be in its ``block_tables`` row.
    """
    _check_inputs(query, kv_cache, layer, query_start_loc, seq_lens, block_tables, out)
    if out is None:
        out = torch.empty_like(query)
    num_tokens, num_heads, head_dim = query.shape
    _, _, _, block_size, num_kv_heads, _ = kv_cache.shape
    batch = seq_lens.shape[0]
    if batch == 0 or num_tokens == 0:
        return out
    attention_kernel = jit(_paged_attention_kernel)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())

    num_queries_per_kv = num_heads // num_kv_heads
    config = _launch_config(num_queries_per_kv, head_dim, max_query_len)
    block_q = config.block_m // num_queries_per_kv
    num_q_blocks = num_tokens // block_q + batch  # upper bound; spare programs exit at once
    if num_splits is None:
        decode_like_q_blocks = batch + max(0, num_tokens - batch) // block_q
        num_splits = choose_num_splits(
            decode_like_q_blocks, num_kv_heads, max_seq_len, _num_sms(query.device)
        )
    elif num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    _check_window(window, softcap)

    if num_splits > 1:
        partial_out = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        partial_max = torch.empty(
            (num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        partial_sum = torch.empty_like(partial_max)
    else:  # Unused by the kernel; any fp32 tensor will do.
        partial_out = partial_max = partial_sum = out.new_empty((1,), dtype=torch.float32)

    attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        query,
        kv_cache,
        out,
        partial_out,
        partial_max,
        partial_sum,
        query_start_loc,
        seq_lens,
        block_tables,
        batch,
        layer,
        num_heads,
        head_dim,
        float(scale) if softcap is not None else float(scale) * _LOG2_E,
        float(softcap or 1.0),
        int(window or 0),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        block_tables.stride(0),
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m,
        BLOCK_Q=block_q,
        TILE_N=config.tile_n,
        HEAD_DIM_PADDED=config.head_dim_padded,
        NUM_SPLITS=num_splits,
        # fp32 is the precise debugging dtype: no tf32 rounding inside tl.dot.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SLIDING=window is not None,
        SOFTCAP=softcap is not None,
        num_warps=config.num_warps,
    )
    if num_splits > 1:
        jit(_paged_attention_reduce_kernel)[(num_tokens, num_heads)](
            out,
            partial_out,
            partial_max,
            partial_sum,
            query_start_loc,
            batch,
            num_heads,
            head_dim,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_splits,
            SPLITS_PADDED=next_power_of_2(num_splits),
            HEAD_DIM_PADDED=config.head_dim_padded,
        )
    return out


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    layer: int,
    query_start_loc: torch.Tensor,  # [batch + 1] int32
    seq_lens: torch.Tensor,  # [batch] int32
    block_tables: torch.Tensor,  # [batch, max_blocks_per_seq] int32
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Torch version of :func:`paged_attention`: gathers each request's K/V, softmax in fp32.

    Also checks what the kernel cannot (consistent lengths, enough blocks) and raises ValueError.
    The two hints are accepted for signature parity and ignored.
    """
    _check_inputs(query, kv_cache, layer, query_start_loc, seq_lens, block_tables, out)
    _check_window(window, softcap)
    if out is None:
        out = torch.empty_like(query)
    _, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_queries_per_kv = query.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if starts and (starts[0] < 0 or starts[-1] > query.shape[0]):
        raise ValueError(f"query_start_loc {starts} does not fit {query.shape[0]} query rows")
    for b, seq_len in enumerate(lens):
        start, end = starts[b], starts[b + 1]
        q_len = end - start
        if q_len < 0 or q_len > seq_len:
            raise ValueError(f"request {b}: need 0 <= q_len ({q_len}) <= seq_len ({seq_len})")
        if q_len == 0:
            continue
        num_blocks = math.ceil(seq_len / block_size)
        if num_blocks > block_tables.shape[1]:
            raise ValueError(
                f"request {b}: seq_len {seq_len} needs {num_blocks} blocks, "
                f"block_tables has {block_tables.shape[1]} columns"
            )
        blocks = block_tables[b, :num_blocks].long()
        kv = kv_cache[blocks, layer].float()  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        k = kv[:, 0].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [seq_len, kv_heads, head_dim]
        v = kv[:, 1].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k = k.repeat_interleave(num_queries_per_kv, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.repeat_interleave(num_queries_per_kv, dim=1)
        q = query[start:end].float()  # [q_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, q_len, seq_len]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        hidden = k_pos[None, None, :] > q_pos[None, :, None]
        if window is not None:
            hidden |= k_pos[None, None, :] <= q_pos[None, :, None] - window
        scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
