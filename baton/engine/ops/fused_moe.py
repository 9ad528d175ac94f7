"""Mixture-of-experts MLP as two grouped GEMMs (Triton + torch reference).

Each token goes to ``top_k`` experts: ``num_tokens * top_k`` (token, expert) *pairs*, pair
``p = token * top_k + slot``. The pairs are sorted by expert and each expert's run padded to a
multiple of ``BLOCK_M`` (:func:`align_pairs`), so every ``BLOCK_M`` rows of the sorted list
belong to one expert. One kernel launch then computes every expert's tiles: a program owns a
``BLOCK_M x BLOCK_N`` output tile, looks up its expert, gathers its pairs' input rows and
multiplies them by that expert's weight; padding rows are masked. The first launch computes
``gate_up = x @ W13[e].T`` per pair, torch applies SiLU-and-multiply, the second launch computes
``down = h @ W2[e].T`` scaled by the routing weight, and a sum over the ``top_k`` slots gives each
token's output. Nothing syncs with the host: the sorted list is sized for the worst case and
programs past its used length exit at once.

Triton is imported and the kernel jitted on first launch (see ``launch``), so the module and its
reference work without triton.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from baton.engine.ops.launch import SUPPORTED_DTYPES, jit

# triton.language, bound by `launch.jit` on first launch (this module imports without triton).
tl: Any = None

__all__ = ["align_pairs", "fused_moe", "fused_moe_reference"]


def _grouped_gemm_kernel(
    a_ptr,  # [num_rows, K]: tokens (first GEMM, A_ROWS_PER_PAIR 0) or pairs (second GEMM)
    b_ptr,  # [num_experts, N, K]: each expert's weight, as nn.Linear stores it
    c_ptr,  # [num_pairs, N]
    weights_ptr,  # [num_pairs] float32 routing weights; read when MUL_WEIGHT
    sorted_pairs_ptr,  # [max_sorted] int32: pair ids grouped by expert; padding = num_pairs
    block_expert_ptr,  # [max_sorted / BLOCK_M] int32: the expert of each BLOCK_M rows
    num_sorted_ptr,  # [1] int32: rows of sorted_pairs in use (a multiple of BLOCK_M)
    num_pairs,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    TOP_K: tl.constexpr,  # a row of A serves TOP_K consecutive pairs (1 when A is per pair)
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block_m = tl.program_id(0)
    block_n = tl.program_id(1)
    if block_m * BLOCK_M >= tl.load(num_sorted_ptr):
        return
    expert = tl.load(block_expert_ptr + block_m).to(tl.int64)
    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    pairs = tl.load(sorted_pairs_ptr + offs_m)  # [BLOCK_M]
    row_valid = pairs < num_pairs  # [BLOCK_M]
    rows = (pairs // TOP_K).to(tl.int64)  # [BLOCK_M] rows of A
    offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]

    a_tile = a_ptr + rows[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    b_tile = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_valid = offs_k < K - k * BLOCK_K  # [BLOCK_K]
        a = tl.load(a_tile, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_tile, mask=k_valid[:, None] & n_valid[None, :], other=0.0)  # [K, N]
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_tile += BLOCK_K
        b_tile += BLOCK_K
    if MUL_WEIGHT:
        weight = tl.load(weights_ptr + pairs, mask=row_valid, other=0.0)  # [BLOCK_M]
        acc = acc * weight[:, None]
    c = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & n_valid[None, :])


class AlignedPairs(NamedTuple):
    """The (token, expert) pairs grouped by expert, each expert's run padded to BLOCK_M rows."""

    sorted_pairs: torch.Tensor  # [max_sorted] int32 pair ids; padding rows hold num_pairs
    block_expert: torch.Tensor  # [max_sorted / block_m] int32 expert of each block of rows
    num_sorted: torch.Tensor  # [1] int32 rows in use


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """Groups ``topk_ids`` [num_tokens, top_k] by expert without a host sync: the list has room
    for the worst case (every expert's run needing a padding block)."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [num_pairs]
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)  # pairs by expert
    counts = torch.bincount(flat, minlength=num_experts)  # [num_experts]
    blocks = (counts + block_m - 1) // block_m  # [num_experts] blocks per expert
    block_end = torch.cumsum(blocks, 0)  # [num_experts]
    run_start = torch.cumsum(counts, 0) - counts  # [num_experts] first sorted pair of expert
    expert_of = flat[order]  # [num_pairs]
    rank = torch.arange(num_pairs, device=device) - run_start[expert_of]  # place within its run
    dest = (block_end - blocks)[expert_of] * block_m + rank  # [num_pairs]
    max_blocks = -(-num_pairs // block_m) + num_experts
    sorted_pairs = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_ids = torch.arange(max_blocks, device=device)
    block_expert = torch.searchsorted(block_end, block_ids, right=True)
    block_expert = block_expert.clamp_(max=num_experts - 1).to(torch.int32)
    num_sorted = (block_end[-1:] * block_m).to(torch.int32)
    return AlignedPairs(sorted_pairs, block_expert, num_sorted)


class _Tiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int


def _tiles(num_pairs: int, num_experts: int) -> _Tiles:
    # Decode-sized batches leave most experts with a few rows: a short BLOCK_M wastes less on
    # padding. 16 is tl.dot's minimum.
    block_m = 16 if num_pairs <= 4 * num_experts else 64
    return _Tiles(block_m, 64, 64 if block_m == 16 else 32, 4)


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    aligned: AlignedPairs,
    tiles: _Tiles,
    top_k: int,
    weights: torch.Tensor | None,
) -> None:
    num_pairs, n = out.shape
    k = a.shape[1]
    grid = (aligned.block_expert.shape[0], -(-n // tiles.block_n))
    jit(_grouped_gemm_kernel)[grid](
        a,
        b,
        out,
        weights if weights is not None else out,
        aligned.sorted_pairs,
        aligned.block_expert,
        aligned.num_sorted,
        num_pairs,
        n,
        k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        TOP_K=top_k,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        # fp32 is the precise debugging dtype: no tf32 rounding inside tl.dot.
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps,
    )


def _check_inputs(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    if x.dim() != 2 or gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(
            "need x [num_tokens, hidden], gate_up_proj [experts, 2 * inter, hidden], down_proj "
            f"[experts, hidden, inter]; got {tuple(x.shape)}, {tuple(gate_up_proj.shape)}, "
            f"{tuple(down_proj.shape)}"
        )
    num_experts, two_inter, hidden = gate_up_proj.shape
    expected_down = (num_experts, hidden, two_inter // 2)
    if x.shape[1] != hidden or two_inter % 2 or down_proj.shape != expected_down:
        raise ValueError(
            f"shapes do not agree: x {tuple(x.shape)}, gate_up_proj {tuple(gate_up_proj.shape)}, "
            f"down_proj {tuple(down_proj.shape)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[:1] != x.shape[:1]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [num_tokens={x.shape[0]}, top_k]"
        )
    if x.dtype not in SUPPORTED_DTYPES or {gate_up_proj.dtype, down_proj.dtype} != {x.dtype}:
        raise ValueError(
            f"x, gate_up_proj and down_proj must share one dtype of {SUPPORTED_DTYPES}; got "
            f"{x.dtype}, {gate_up_proj.dtype}, {down_proj.dtype}"
        )
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got {t.stride()}")


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    gate_up_proj: torch.Tensor,  # [num_experts, 2 * inter, hidden]
    down_proj: torch.Tensor,  # [num_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k] expert ids in [0, num_experts)
) -> torch.Tensor:  # [num_tokens, hidden], x's dtype
    """Sum over each token's ``top_k`` experts of weight * down(silu(gate(x)) * up(x)).

    Expert ids are not checked on device: each must be in ``[0, num_experts)``.
    """
    _check_inputs(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = gate_up_proj.shape
    if num_tokens == 0:
        return x.new_zeros(0, hidden)
    num_pairs = num_tokens * top_k
    tiles = _tiles(num_pairs, num_experts)
    aligned = align_pairs(topk_ids, num_experts, tiles.block_m)
    x = x.contiguous()
    gate_up = x.new_empty(num_pairs, two_inter)  # [num_pairs, 2 * inter]
    _grouped_gemm(x, gate_up_proj, gate_up, aligned, tiles, top_k, None)
    gate, up = gate_up.chunk(2, dim=-1)
    h = F.silu(gate) * up  # [num_pairs, inter]
    down = x.new_empty(num_pairs, hidden)  # [num_pairs, hidden], routing weight applied
    weights = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(h, down_proj, down, aligned, tiles, 1, weights)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)


def fused_moe_reference(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Torch version of :func:`fused_moe`: each pair's expert weights gathered, in float32."""
    _check_inputs(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    w13 = gate_up_proj[topk_ids].float()  # [num_tokens, top_k, 2 * inter, hidden]
    w2 = down_proj[topk_ids].float()  # [num_tokens, top_k, hidden, inter]
    gate, up = torch.einsum("th,tkih->tki", x.float(), w13).chunk(2, dim=-1)
    down = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, w2)  # [num_tokens, top_k, hidden]
    return (down * topk_weights.float().unsqueeze(-1)).sum(dim=1).to(x.dtype)
