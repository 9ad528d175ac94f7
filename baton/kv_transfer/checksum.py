"""The checksums of KV transfers: one 64-bit value per block, and xxh3 of those values for a
whole transfer.

Both transports check what arrived against values the serving side computed when it leased the
blocks. Two kinds of block value, named by the serving side:
- ``xxh3``: xxh3-64 of the block's bytes, for blocks in host memory and for every TCP transfer
  (which stages device blocks through host buffers and checks the staged bytes). It ran at about
  17 GB/s on this project's CPU machines against about 4 GB/s for zlib's crc32 (64 KiB blocks).
- ``sum64``: for NIXL from device memory, computed where the blocks live so that the transfer stays
  zero-copy. The block's 32-bit words, each times a fixed odd 64-bit weight for its position,
  summed modulo 2**64: two torch ops, the same value on any device. One changed word always changes
  it (an odd weight times a nonzero difference under 2**32 is never 0 modulo 2**64); a torn,
  stale, zeroed or misplaced block differs in many words and matches by chance with a
  probability of about 2**-(64 - v), v the trailing zero bits every changed word's difference
  shares (few for real data, whose low bits differ). It is linear, so it is no defence against a
  peer that crafts blocks: the channel's keys are (see ``keyring.py``). It reads each word once
  and writes a 64-bit product, so it is bound by memory bandwidth on a GPU; on a CPU it ran at
  0.3-0.4 GB/s on one core, which is why host blocks keep xxh3 (bench/checksum.py prints both).
"""

from __future__ import annotations

import functools
import math
import struct
import weakref
from collections.abc import Sequence

import torch
import xxhash

XXH3 = "xxh3"
SUM64 = "sum64"
KINDS = (XXH3, SUM64)
# sum64 takes this many words of blocks per pass, bounding its 64-bit temporaries (256 MiB).
_SUM64_WORDS = 1 << 25


def block_checksum(data: memoryview | bytes) -> int:
    """The checksum of one block's bytes (an unsigned 64-bit value)."""
    return xxhash.xxh3_64_intdigest(data)


def combine(checksums: Sequence[int]) -> int:
    """The checksum of a transfer: over its blocks' checksums, in transfer order."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"!{len(checksums)}Q", *checksums))


def block_bytes(kv_cache: torch.Tensor) -> int:
    """Bytes of one block of all layers: ``kv_cache[0]``."""
    return math.prod(kv_cache.shape[1:]) * kv_cache.element_size()


def byte_view(kv_cache: torch.Tensor) -> memoryview:
    """A writable memoryview over the tensor's own storage (no copy). Made once per tensor: with
    its four torch calls a warm 64 KiB KV read took ~50 µs more of the reader's CPU, a fifth of
    the read (KV caches are never resized, which would leave a kept view stale)."""
    kept = _views.get(id(kv_cache))
    if kept is not None and kept[0]() is kv_cache:
        return kept[1]
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous() or kv_cache.dim() < 1:
        raise ValueError(
            "kv_cache must be a contiguous CPU tensor [num_blocks, ...], got "
            f"device={kv_cache.device} contiguous={kv_cache.is_contiguous()} "
            f"shape={tuple(kv_cache.shape)}"
        )
    # view(uint8) reinterprets the bytes of any dtype (bf16 included, which numpy lacks).
    view = kv_cache.detach().reshape(-1).view(torch.uint8).numpy().data
    # The view holds the storage, not this tensor object: the entry goes with the tensor.
    key = id(kv_cache)
    _views[key] = (weakref.ref(kv_cache, lambda _: _views.pop(key, None)), view)
    return view


# id(tensor) -> (a weak reference to the tensor, its byte view)
_views: dict[int, tuple[weakref.ref[torch.Tensor], memoryview]] = {}


def kind_for(kv_cache: torch.Tensor) -> str:
    """The kind of block checksum a NIXL server computes for its cache: sum64 where the blocks
    are in device memory, xxh3 in host memory."""
    return XXH3 if kv_cache.device.type == "cpu" else SUM64


def block_crcs(kv_cache: torch.Tensor, block_ids: list[int], kind: str = XXH3) -> list[int]:
    """The checksum of each block, in the order given. xxh3 copies device blocks to the host first;
    sum64 runs where the blocks are."""
    if kind == SUM64:
        return block_sum64(kv_cache, block_ids)
    if kind != XXH3:
        raise ValueError(f"unknown block checksum {kind!r}; known: {', '.join(KINDS)}")
    if kv_cache.device.type != "cpu":
        kv_cache = kv_cache[block_ids].cpu()
        block_ids = list(range(len(block_ids)))
    view, bpb = byte_view(kv_cache), block_bytes(kv_cache)
    return [block_checksum(view[b * bpb : (b + 1) * bpb]) for b in block_ids]


@functools.lru_cache(maxsize=8)
def _weights(words: int, device: torch.device) -> torch.Tensor:
    """sum64's weight of each word position: odd 64-bit values from a fixed seed, so that every
    engine on every device uses the same ones."""
    gen = torch.Generator().manual_seed(0x6261746F6E)  # b"baton"
    w = torch.randint(-(2**63), 2**63 - 1, (words,), dtype=torch.int64, generator=gen)
    return (w | 1).to(device)


def block_sum64(kv_cache: torch.Tensor, block_ids: list[int]) -> list[int]:
    """sum64 (see the module docstring) of each block, computed on the cache's device."""
    if not kv_cache.is_contiguous() or kv_cache.dim() < 1:
        raise ValueError(f"kv_cache must be contiguous [num_blocks, ...], got {kv_cache.shape}")
    if not block_ids:
        return []
    rows = kv_cache.detach().reshape(kv_cache.shape[0], -1).view(torch.uint8)
    # The widest word that divides a block; 32 bits for every real cache.
    word = (
        torch.int32 if rows.shape[1] % 4 == 0 else torch.int16 if rows.shape[1] % 2 == 0 else None
    )
    words = rows.view(word) if word is not None else rows
    weights = _weights(words.shape[1], kv_cache.device)
    ids = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    per_pass = max(1, _SUM64_WORDS // words.shape[1])
    sums = [
        (words.index_select(0, ids[i : i + per_pass]).to(torch.int64) * weights).sum(1)
        for i in range(0, len(block_ids), per_pass)
    ]
    return [v % (1 << 64) for v in torch.cat(sums).tolist()]
