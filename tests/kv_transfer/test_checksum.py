"""Block checksums: xxh3 for host blocks and TCP, sum64 computed where device blocks live (NIXL).
What sum64 must catch: any changed word, a torn block (part old, part new), a stale or zeroed
block, and blocks in the wrong order; and it must give the same value on every device."""

from __future__ import annotations

import gc

import pytest
import torch

from baton.kv_transfer import checksum as checksum_mod
from baton.kv_transfer.checksum import SUM64, XXH3, block_crcs, byte_view, kind_for


def _cache(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, 2, 2, 4, 2, 16, generator=gen).to(dtype)  # [blocks, layers, K/V, ...]


@pytest.mark.parametrize("kind", [XXH3, SUM64])
def test_every_changed_word_changes_the_block_value(kind: str) -> None:
    kv = _cache()
    base = block_crcs(kv, [0, 1, 2], kind)
    words = kv.view(kv.shape[0], -1).view(torch.int32)
    for pos in range(0, words.shape[1], 7):
        for delta in (1, 1 << 31, -1):
            changed = kv.clone()
            row = changed.view(kv.shape[0], -1).view(torch.int32)[1]
            row[pos] = int(row[pos]) + delta if -(2**31) <= int(row[pos]) + delta < 2**31 else 0
            got = block_crcs(changed, [0, 1, 2], kind)
            assert got[0] == base[0] and got[2] == base[2]
            assert got[1] != base[1], (pos, delta)


@pytest.mark.parametrize("kind", [XXH3, SUM64])
def test_torn_stale_zeroed_and_reordered_blocks_are_caught(kind: str) -> None:
    kv, stale = _cache(seed=1), _cache(seed=2)
    want = block_crcs(kv, [3, 4], kind)
    torn = kv.clone()
    half = torn[3].numel() // 2
    torn[3].view(-1)[half:] = stale[3].view(-1)[half:]
    assert block_crcs(torn, [3], kind)[0] != want[0]
    assert block_crcs(stale, [3, 4], kind) != want
    assert block_crcs(torch.zeros_like(kv), [3], kind)[0] != want[0]
    assert block_crcs(kv, [4, 3], kind) == want[::-1] != want  # per block, in the order asked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
def test_sum64_is_an_unsigned_64_bit_value_per_block_for_every_kv_dtype(dtype: torch.dtype) -> None:
    kv = (_cache() * 50).to(dtype)
    values = block_crcs(kv, list(range(8)), SUM64)
    assert len(set(values)) == 8 and all(0 <= v < 2**64 for v in values)
    odd = torch.arange(8 * 3, dtype=torch.uint8).view(8, 3)  # 3-byte blocks: byte words
    assert len(set(block_crcs(odd, list(range(8)), SUM64))) == 8


def test_sum64_passes_bound_memory_without_changing_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from baton.kv_transfer import checksum

    kv = _cache()
    whole = block_crcs(kv, [5, 0, 7, 7], SUM64)
    monkeypatch.setattr(checksum, "_SUM64_WORDS", 1)  # one block per pass
    assert block_crcs(kv, [5, 0, 7, 7], SUM64) == whole
    assert block_crcs(kv, [], SUM64) == []


def test_the_kind_follows_the_memory_and_unknown_kinds_are_refused() -> None:
    assert kind_for(_cache()) == XXH3
    with pytest.raises(ValueError, match="unknown block checksum"):
        block_crcs(_cache(), [0], "crc32")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sum64_on_the_gpu_equals_sum64_on_the_host() -> None:
    kv = _cache(torch.bfloat16)
    gpu = kv.cuda()
    assert kind_for(gpu) == SUM64
    assert block_crcs(gpu, [6, 1, 2], SUM64) == block_crcs(kv, [6, 1, 2], SUM64)


def test_byte_view_is_made_once_per_tensor_and_goes_with_it() -> None:
    """A KV read asks for its cache's bytes every time: the view is kept per tensor object (the
    same one back, writes through it land in the tensor) and dropped when the tensor goes."""
    cache = torch.zeros(4, 8)
    view = byte_view(cache)
    assert byte_view(cache) is view
    view[0] = 1
    assert cache.view(torch.uint8).reshape(-1)[0] == 1
    other = cache.clone()
    assert byte_view(other) is not view
    key = id(other)
    assert checksum_mod._views[key][0]() is other
    del other
    gc.collect()
    # Its own entry (other tests' tensors may go at the same time: no count of the whole table).
    assert key not in checksum_mod._views
    assert checksum_mod._views[id(cache)][0]() is cache
