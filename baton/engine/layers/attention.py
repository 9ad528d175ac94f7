"""Attention over the paged KV cache: per-step metadata and the torch (CPU) backend.

KV layout: one tensor `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` for all
layers, so a block of every layer is one contiguous region (what the KV connector moves).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from baton.engine.config import ATTENTION_BACKENDS
from baton.engine.ops import cpu_paged_attention


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    query_start_loc: torch.Tensor  # [batch + 1] int32
    seq_lens: torch.Tensor  # [batch] int32: context length after this step's tokens
    block_tables: torch.Tensor  # [batch, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    # Host copies, for backends that plan on the CPU.
    query_start_loc_np: np.ndarray  # [batch + 1]
    seq_lens_np: np.ndarray  # [batch]
    block_tables_np: np.ndarray  # [batch, max_blocks]
    plan: dict[str, object] = field(default_factory=dict)  # a backend's per-step cache


class AttentionBackend(Protocol):
    def __call__(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        layer: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]


@dataclass
class _DecodeGroup:
    token_idx: torch.Tensor  # [g] rows of the batch's tokens
    block_table: torch.Tensor  # [g, blocks] int64
    mask: torch.Tensor | None  # [g, 1, 1, blocks * block_size] bool, None if no padding


@dataclass
class _Decodes:
    """Every decode of the step, for the C kernel."""

    token_idx: torch.Tensor  # [d] int64
    block_tables: torch.Tensor  # [d, max_blocks] int32
    seq_lens: torch.Tensor  # [d] int32


@dataclass
class _Prefill:
    start: int
    end: int
    block_ids: torch.Tensor | None  # [blocks] int64, None when the chunk is the whole context
    mask: torch.Tensor | None  # [q_len, seq_len] bool


@dataclass
class _Plan:
    prefills: list[_Prefill]
    decodes: _Decodes | None  # when the C kernel runs them
    decode_groups: list[_DecodeGroup]  # otherwise: SDPA in groups of similar length


_DECODE_GROUP = 64  # SDPA decodes attend in groups of similar length to bound padding


class TorchAttention:
    """Paged attention on the CPU.

    Prompt chunks go through torch's SDPA one at a time (a whole prompt without any gather).
    Decodes (one query token) go in one call of the C kernel `ops/cpu_paged_attention` when the
    cache is float32, reading blocks in place; otherwise through SDPA on gathered blocks, in
    groups of similar length.
    """

    def __init__(self, block_size: int, scale: float) -> None:
        self.block_size = block_size
        self.scale = scale

    def _plan(self, meta: AttentionMetadata, q: torch.Tensor, kv_cache: torch.Tensor) -> _Plan:
        cached = meta.plan.get("torch")
        if isinstance(cached, _Plan):
            return cached
        device = q.device
        qsl, seq_lens, tables = meta.query_start_loc_np, meta.seq_lens_np, meta.block_tables_np
        q_lens = np.diff(qsl)
        bs = self.block_size
        plan = _Plan(prefills=[], decodes=None, decode_groups=[])
        for row in np.flatnonzero(q_lens > 1):
            start, end, seq_len = int(qsl[row]), int(qsl[row + 1]), int(seq_lens[row])
            context = seq_len - (end - start)
            if context == 0:
                plan.prefills.append(_Prefill(start, end, None, None))
                continue
            nblocks = -(-seq_len // bs)
            block_ids = torch.from_numpy(tables[row, :nblocks].astype(np.int64)).to(device)
            q_pos = np.arange(context, seq_len)[:, None]
            mask = torch.from_numpy(np.arange(seq_len)[None, :] <= q_pos).to(device)
            plan.prefills.append(_Prefill(start, end, block_ids, mask))
        # q_len 1 covers decodes and one-token prompt chunks alike: both read the cache.
        rows = np.flatnonzero(q_lens == 1)
        use_kernel = device.type == "cpu" and cpu_paged_attention.available(
            kv_cache.dtype, q.shape[1], kv_cache.shape[4], kv_cache.shape[5], bs
        )
        if len(rows) and use_kernel:
            plan.decodes = _Decodes(
                token_idx=torch.from_numpy(qsl[rows].astype(np.int64)),
                block_tables=torch.from_numpy(np.ascontiguousarray(tables[rows])),
                seq_lens=torch.from_numpy(np.ascontiguousarray(seq_lens[rows])),
            )
            rows = rows[:0]
        rows = rows[np.argsort(seq_lens[rows], kind="stable")]
        for g in range(0, len(rows), _DECODE_GROUP):
            group = rows[g : g + _DECODE_GROUP]
            lens = seq_lens[group]
            nblocks = int(-(-lens.max() // bs))
            group_mask: torch.Tensor | None = None
            if lens.min() != nblocks * bs:
                pos = np.arange(nblocks * bs)
                group_mask = torch.from_numpy(pos[None, :] < lens[:, None]).to(device)
                group_mask = group_mask.view(len(group), 1, 1, -1)
            plan.decode_groups.append(
                _DecodeGroup(
                    token_idx=torch.from_numpy(qsl[group].astype(np.int64)).to(device),
                    block_table=torch.from_numpy(tables[group, :nblocks].astype(np.int64)).to(
                        device
                    ),
                    mask=group_mask,
                )
            )
        meta.plan["torch"] = plan
        return plan

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        bs = self.block_size
        k_cache = kv_cache[:, layer, 0]  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache = kv_cache[:, layer, 1]
        slots = meta.plan.get("slots")
        if slots is None:
            slots = meta.plan["slots"] = (meta.slot_mapping // bs, meta.slot_mapping % bs)
        k_cache[slots] = k  # type: ignore[index]
        v_cache[slots] = v  # type: ignore[index]

        plan = self._plan(meta, q, kv_cache)
        out = torch.empty_like(q)
        kv_heads, head_dim = k.shape[1], k.shape[2]
        if plan.decodes is not None:
            d = plan.decodes
            out[d.token_idx] = cpu_paged_attention.paged_decode_attention(
                q[d.token_idx], kv_cache, layer, d.block_tables, d.seq_lens, self.scale
            )
        for group in plan.decode_groups:
            n = group.token_idx.shape[0]
            qd = q[group.token_idx].unsqueeze(2)  # [g, heads, 1, head_dim]
            kd = k_cache[group.block_table].view(n, -1, kv_heads, head_dim).transpose(1, 2)
            vd = v_cache[group.block_table].view(n, -1, kv_heads, head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=group.mask, scale=self.scale, enable_gqa=True
            )
            out[group.token_idx] = o.squeeze(2)
        for p in plan.prefills:
            qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
            if p.block_ids is None or p.mask is None:  # the whole context is this chunk
                kp, vp = k[p.start : p.end], v[p.start : p.end]
            else:
                seq_len = p.mask.shape[1]
                kp = k_cache[p.block_ids].view(-1, kv_heads, head_dim)[:seq_len]
                vp = v_cache[p.block_ids].view(-1, kv_heads, head_dim)[:seq_len]
            o = F.scaled_dot_product_attention(
                qp,
                kp.transpose(0, 1).unsqueeze(0),  # [1, kv_heads, seq_len, head_dim]
                vp.transpose(0, 1).unsqueeze(0),
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[p.start : p.end] = o.squeeze(0).transpose(0, 1)
        return out


class TritonAttention:
    """The GPU path: Baton's Triton kernels for the cache write and the mixed-batch attention."""

    def __init__(self, scale: float) -> None:
        from baton.engine.ops.paged_attention import paged_attention
        from baton.engine.ops.reshape_and_cache import reshape_and_cache

        self._write = reshape_and_cache
        self._attend = paged_attention
        self.scale = scale

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        self._write(k, v, kv_cache, layer, meta.slot_mapping)
        return self._attend(
            q,
            kv_cache,
            layer,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            self.scale,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
        )


def make_attention_backend(name: str, block_size: int, scale: float) -> AttentionBackend:
    if name == "torch":
        return TorchAttention(block_size, scale)
    if name == "triton":
        return TritonAttention(scale)
    raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
