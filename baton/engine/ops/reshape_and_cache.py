"""Write one step's new K/V into the paged KV cache (Triton kernel and torch reference).

The cache is one tensor for all layers, ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]`` (dim 2: 0 is K, 1 is V). A token's slot is ``block_id * block_size + offset_in_block``;
a negative slot means "skip this token" (padding).

Triton is imported and the kernels jitted on first launch, not at import: the module imports
without triton (the reference still works), and ``TRITON_INTERPRET=1`` only has to be set before
the first launch, provided nothing else imported triton earlier.
"""

from __future__ import annotations

from typing import Any

import torch

from baton.engine.ops.launch import check_kv_cache, jit, next_power_of_2

# triton.language, bound by `launch.jit` on first launch (this module imports without triton).
tl: Any = None

__all__ = ["reshape_and_cache", "reshape_and_cache_reference"]

# Elements of one K (or V) tile a program moves; bounds registers when num_kv_heads is large.
_MAX_TILE_ELEMENTS = 4096


def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache_ptr,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, negative = skip
    layer,
    num_slots,
    num_kv_heads,
    head_dim,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_cache_block,
    stride_cache_layer,
    stride_cache_kv,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head_tile = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # Out-of-range slots are skipped too: the kernel cannot raise, and writing past the cache
    # would corrupt other memory. The reference raises for them instead.
    if (slot < 0) | (slot >= num_slots):
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]

    token64 = token.to(tl.int64)
    key = tl.load(
        key_ptr + token64 * stride_key_t + offs_h[:, None] * stride_key_h + offs_d[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + token64 * stride_value_t + offs_h[:, None] * stride_value_h + offs_d[None, :],
        mask=mask,
    )
    cache_offs = (
        block * stride_cache_block
        + layer * stride_cache_layer
        + offset * stride_cache_slot
        + offs_h[:, None] * stride_cache_head
        + offs_d[None, :]
    )  # [BLOCK_H, BLOCK_D], K half
    tl.store(kv_cache_ptr + cache_offs, key, mask=mask)
    tl.store(kv_cache_ptr + cache_offs + stride_cache_kv, value, mask=mask)


def _check_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> None:
    check_kv_cache(kv_cache, layer)
    _, _, _, _, num_kv_heads, head_dim = kv_cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] to match kv_cache, "
                f"got {tuple(t.shape)}"
            )
        if t.dtype != kv_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from kv_cache dtype {kv_cache.dtype}")
        if t.device != kv_cache.device:
            raise ValueError(f"{name} is on {t.device} but kv_cache is on {kv_cache.device}")
        if t.shape[0] > 0 and t.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"key has {key.shape[0]} tokens but value has {value.shape[0]}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping must be [num_tokens={key.shape[0]}], got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if slot_mapping.device != kv_cache.device:
        raise ValueError(
            f"slot_mapping is on {slot_mapping.device} but kv_cache is on {kv_cache.device}"
        )


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    layer: int,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Write ``key``/``value`` of each token into ``kv_cache[:, layer]`` at its slot, in place.

    Tokens with a negative slot are skipped (padding). Slots past the end of the cache are also
    skipped rather than written out of bounds; use the reference to catch them in tests.
    """
    _check_inputs(key, value, kv_cache, layer, slot_mapping)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    num_blocks, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    kernel = jit(_reshape_and_cache_kernel)
    block_d = next_power_of_2(head_dim)
    block_h = min(next_power_of_2(num_kv_heads), max(1, _MAX_TILE_ELEMENTS // block_d))
    grid = (num_tokens, (num_kv_heads + block_h - 1) // block_h)
    kernel[grid](
        key,
        value,
        kv_cache,
        slot_mapping,
        layer,
        num_blocks * block_size,
        num_kv_heads,
        head_dim,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )


def reshape_and_cache_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    layer: int,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Torch version of :func:`reshape_and_cache`; raises ValueError for out-of-range slots."""
    _check_inputs(key, value, kv_cache, layer, slot_mapping)
    num_blocks, _, _, block_size, _, _ = kv_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    if slots.numel() > 0 and int(slots.max()) >= num_blocks * block_size:
        raise ValueError(
            f"slot {int(slots.max())} is past the cache's {num_blocks * block_size} slots"
        )
    blocks = slots // block_size
    offsets = slots % block_size
    kv_cache[blocks, layer, 0, offsets] = key[keep]
    kv_cache[blocks, layer, 1, offsets] = value[keep]
