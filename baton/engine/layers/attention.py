"""Attention over the paged KV cache: per-step metadata and the torch (CPU) backend.

KV layout: one tensor `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` for all
layers, so a block of every layer is one contiguous region (what the KV connector moves).
Each layer attends as its `AttentionSpec` says (scale, sliding window, logit soft-capping). A
windowed layer never reads blocks that lie wholly before its window: the KV cache manager may
have given them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from baton.engine.config import ATTENTION_BACKENDS
from baton.engine.ops import cpu_paged_attention


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer attends."""

    scale: float  # applied to q.k before soft-capping
    window: int | None = None  # a query at position p sees keys at positions > p - window
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap)

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.softcap is not None and self.softcap <= 0:
            raise ValueError(f"softcap must be > 0, got {self.softcap}")


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
    block_table: torch.Tensor  # [g, blocks] int64, from the group's first block in any window
    mask: torch.Tensor | None  # [g, 1, 1, blocks * block_size] bool, None if all visible


@dataclass
class _Decodes:
    """Every decode of the step, for the C kernel."""

    token_idx: torch.Tensor | None  # [d] int64; None when they are the step's every token
    block_tables: torch.Tensor  # [d, max_blocks] int32
    seq_lens: torch.Tensor  # [d] int32
    starts: torch.Tensor | None  # [d] int32 first visible key position, None without a window


@dataclass
class _Prefill:
    start: int
    end: int
    block_ids: torch.Tensor | None  # [blocks] int64 from the window's first; None: this chunk's
    mask: torch.Tensor | None  # [q_len, keys] bool; None: causal over this chunk
    num_keys: int  # keys read: from block_ids[0]'s first slot (or the chunk's first token)


@dataclass
class _Plan:
    prefills: list[_Prefill]
    decodes: _Decodes | None  # when the C kernel runs them
    decode_groups: list[_DecodeGroup]  # otherwise: SDPA in groups of similar length


_DECODE_GROUP = 64  # SDPA decodes attend in groups of similar length to bound padding


def _visible(
    q_pos: np.ndarray, k_pos: np.ndarray, window: int | None
) -> np.ndarray:  # [..., q, k] bool
    """Causal, and within the window where there is one."""
    seen = k_pos <= q_pos
    if window is not None:
        seen &= k_pos > q_pos - window
    return seen


def _attend(
    q: torch.Tensor,  # [b, heads, q_len, head_dim]
    k: torch.Tensor,  # [b, kv_heads, keys, head_dim]
    v: torch.Tensor,  # [b, kv_heads, keys, head_dim]
    mask: torch.Tensor | None,  # broadcastable to [b, heads, q_len, keys] bool
    spec: AttentionSpec,
    causal: bool,  # with no mask: q_len == keys and causal, or every key visible
) -> torch.Tensor:  # [b, heads, q_len, head_dim]
    if spec.softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=spec.scale, enable_gqa=True
        )
    # SDPA has no soft-capping: the scores are materialised, in float32 as transformers does.
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * spec.scale
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if causal:
        n = scores.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(probs, v)


class TorchAttention:
    """Paged attention on the CPU.

    Prompt chunks go through torch's SDPA one at a time (a whole prompt without any gather).
    Decodes (one query token) go in one call of the C kernel `ops/cpu_paged_attention` when the
    cache is float32, reading blocks in place; otherwise through SDPA on gathered blocks, in
    groups of similar length. Layers with soft-capping use a plain matmul-softmax instead of
    SDPA. The plan of a step is built once per distinct window and shared by those layers.
    """

    def __init__(self, block_size: int, specs: Sequence[AttentionSpec]) -> None:
        self.block_size = block_size
        self.specs = tuple(specs)

    def _plan(
        self, meta: AttentionMetadata, q: torch.Tensor, kv_cache: torch.Tensor, window: int | None
    ) -> _Plan:
        key = f"torch/{window}"
        cached = meta.plan.get(key)
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
            q_pos = np.arange(context, seq_len)[:, None]
            if context == 0:  # the chunk is the whole context: no gather
                mask = None
                if window is not None and seq_len > window:
                    mask = torch.from_numpy(_visible(q_pos, q_pos.T, window)).to(device)
                plan.prefills.append(_Prefill(start, end, None, mask, seq_len))
                continue
            # The first query's window opens at context - window + 1: no earlier block is read.
            first = max(0, context - window + 1) // bs if window is not None else 0
            nblocks = -(-seq_len // bs)
            block_ids = torch.from_numpy(tables[row, first:nblocks].astype(np.int64)).to(device)
            k_pos = np.arange(first * bs, seq_len)[None, :]
            mask = torch.from_numpy(_visible(q_pos, k_pos, window)).to(device)
            plan.prefills.append(_Prefill(start, end, block_ids, mask, seq_len - first * bs))
        # q_len 1 covers decodes and one-token prompt chunks alike: both read the cache.
        rows = np.flatnonzero(q_lens == 1)
        use_kernel = device.type == "cpu" and cpu_paged_attention.available(
            kv_cache.dtype, q.shape[1], kv_cache.shape[4], kv_cache.shape[5], bs
        )
        if len(rows) and use_kernel:
            starts = None
            if window is not None:
                starts = torch.from_numpy(
                    np.maximum(seq_lens[rows] - window, 0).astype(np.int32, copy=False)
                )
            every = len(rows) == q.shape[0]  # in order then: one token a request
            plan.decodes = _Decodes(
                token_idx=None if every else torch.from_numpy(qsl[rows].astype(np.int64)),
                block_tables=torch.from_numpy(np.ascontiguousarray(tables[rows])),
                seq_lens=torch.from_numpy(np.ascontiguousarray(seq_lens[rows])),
                starts=starts,
            )
            rows = rows[:0]
        rows = rows[np.argsort(seq_lens[rows], kind="stable")]
        for g in range(0, len(rows), _DECODE_GROUP):
            group = rows[g : g + _DECODE_GROUP]
            lens = seq_lens[group]
            nblocks = int(-(-lens.max() // bs))
            first = 0
            if window is not None:
                first = int(max(0, lens.min() - window)) // bs
            group_mask: torch.Tensor | None = None
            k_pos = np.arange(first * bs, nblocks * bs)[None, :]
            visible = _visible(lens[:, None] - 1, k_pos, window)
            if not visible.all():
                group_mask = torch.from_numpy(visible).to(device).view(len(group), 1, 1, -1)
            plan.decode_groups.append(
                _DecodeGroup(
                    token_idx=torch.from_numpy(qsl[group].astype(np.int64)).to(device),
                    block_table=torch.from_numpy(tables[group, first:nblocks].astype(np.int64)).to(
                        device
                    ),
                    mask=group_mask,
                )
            )
        meta.plan[key] = plan
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
        spec = self.specs[layer]
        k_cache = kv_cache[:, layer, 0]  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache = kv_cache[:, layer, 1]
        slots = meta.plan.get("slots")
        if slots is None:
            slots = meta.plan["slots"] = (meta.slot_mapping // bs, meta.slot_mapping % bs)
        k_cache[slots] = k  # type: ignore[index]
        v_cache[slots] = v  # type: ignore[index]

        plan = self._plan(meta, q, kv_cache, spec.window)
        d = plan.decodes
        if d is not None and d.token_idx is None:  # only decodes: no gather, no scatter
            return self._decode(q, kv_cache, layer, d, spec)
        out = torch.empty_like(q)
        kv_heads, head_dim = k.shape[1], k.shape[2]
        if d is not None:
            out[d.token_idx] = self._decode(q[d.token_idx], kv_cache, layer, d, spec)
        for group in plan.decode_groups:
            n = group.token_idx.shape[0]
            qd = q[group.token_idx].unsqueeze(2)  # [g, heads, 1, head_dim]
            kd = k_cache[group.block_table].view(n, -1, kv_heads, head_dim).transpose(1, 2)
            vd = v_cache[group.block_table].view(n, -1, kv_heads, head_dim).transpose(1, 2)
            o = _attend(qd, kd, vd, group.mask, spec, causal=False)
            out[group.token_idx] = o.squeeze(2)
        for p in plan.prefills:
            qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
            if p.block_ids is None:  # the whole context is this chunk
                kp, vp = k[p.start : p.end], v[p.start : p.end]
            else:
                kp = k_cache[p.block_ids].view(-1, kv_heads, head_dim)[: p.num_keys]
                vp = v_cache[p.block_ids].view(-1, kv_heads, head_dim)[: p.num_keys]
            o = _attend(
                qp,
                kp.transpose(0, 1).unsqueeze(0),  # [1, kv_heads, keys, head_dim]
                vp.transpose(0, 1).unsqueeze(0),
                p.mask,
                spec,
                causal=p.mask is None,
            )
            out[p.start : p.end] = o.squeeze(0).transpose(0, 1)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor, kv_cache: torch.Tensor, layer: int, d: _Decodes, spec: AttentionSpec
    ) -> torch.Tensor:
        return cpu_paged_attention.paged_decode_attention(
            q,
            kv_cache,
            layer,
            d.block_tables,
            d.seq_lens,
            spec.scale,
            starts=d.starts,
            softcap=spec.softcap,
        )


class TritonAttention:
    """The GPU path: Baton's Triton kernels for the cache write and the mixed-batch attention."""

    def __init__(self, specs: Sequence[AttentionSpec]) -> None:
        from baton.engine.ops.paged_attention import paged_attention
        from baton.engine.ops.reshape_and_cache import reshape_and_cache

        self._write = reshape_and_cache
        self._attend = paged_attention
        self.specs = tuple(specs)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        spec = self.specs[layer]
        self._write(k, v, kv_cache, layer, meta.slot_mapping)
        return self._attend(
            q,
            kv_cache,
            layer,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            spec.scale,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            window=spec.window,
            softcap=spec.softcap,
        )


def make_attention_backend(
    name: str, block_size: int, specs: Sequence[AttentionSpec]
) -> AttentionBackend:
    """The backend `name`, attending in layer i as `specs[i]` says."""
    if name == "torch":
        return TorchAttention(block_size, specs)
    if name == "triton":
        return TritonAttention(specs)
    raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
