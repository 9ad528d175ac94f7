"""The checksum of KV transfers: xxh3-64 of each block, and of those values for a whole transfer.

Both transports check what arrived against values the serving side computed when it leased the
blocks. xxh3 ran at about 17 GB/s on this project's CPU machines against about 4 GB/s for zlib's
crc32 (64 KiB blocks), so the check costs a quarter of what crc32 did and a transfer's receive
side spends its time receiving; a 64-bit value also makes an accidental match negligible.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch
import xxhash


def block_checksum(data: memoryview | bytes) -> int:
    """The checksum of one block's bytes (an unsigned 64-bit value)."""
    return xxhash.xxh3_64_intdigest(data)


def combine(checksums: Sequence[int]) -> int:
    """The checksum of a transfer: over its blocks' checksums, in transfer order."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"!{len(checksums)}Q", *checksums))


def block_bytes(kv_cache: torch.Tensor) -> int:
    """Bytes of one block of all layers: ``kv_cache[0]``."""
    return kv_cache[0].numel() * kv_cache.element_size()


def byte_view(kv_cache: torch.Tensor) -> memoryview:
    """A writable memoryview over the tensor's own storage (no copy)."""
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous() or kv_cache.dim() < 1:
        raise ValueError(
            "kv_cache must be a contiguous CPU tensor [num_blocks, ...], got "
            f"device={kv_cache.device} contiguous={kv_cache.is_contiguous()} "
            f"shape={tuple(kv_cache.shape)}"
        )
    # view(uint8) reinterprets the bytes of any dtype (bf16 included, which numpy lacks).
    return kv_cache.detach().reshape(-1).view(torch.uint8).numpy().data


def block_crcs(kv_cache: torch.Tensor, block_ids: list[int]) -> list[int]:
    """The checksum of each block's bytes, in the order given; device blocks are copied to host
    first."""
    if kv_cache.device.type != "cpu":
        kv_cache = kv_cache[block_ids].cpu()
        block_ids = list(range(len(block_ids)))
    view, bpb = byte_view(kv_cache), block_bytes(kv_cache)
    return [block_checksum(view[b * bpb : (b + 1) * bpb]) for b in block_ids]
