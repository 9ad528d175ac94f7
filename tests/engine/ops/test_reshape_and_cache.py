"""reshape_and_cache: the Triton kernel against its torch reference."""

import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from baton.engine.ops.reshape_and_cache import (
    _reshape_and_cache_kernel,
    reshape_and_cache,
    reshape_and_cache_reference,
)

NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE = 6, 3, 4


def _make(
    device: torch.device, num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache of random values, and K/V as views into a fused qkv projection (strided rows)."""
    cache = torch.randn(
        NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, num_kv_heads, head_dim, device=device
    ).to(dtype)
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, device=device).to(dtype)
    # Shuffled distinct slots, crossing block boundaries, with padding tokens in between.
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device=device)[:num_tokens]
    slots[1::4] = -1
    return qkv[:, 1], qkv[:, 2], cache, slots


@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "dtype"),
    [
        (1, 16, torch.float32),
        (2, 32, torch.float16),
        (4, 64, torch.bfloat16),
        (8, 128, torch.float32),
        (3, 80, torch.float32),
    ],
)
def test_matches_reference(
    device: torch.device, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """The kernel writes exactly what the reference writes, skipping padding and other layers."""
    key, value, cache, slots = _make(device, 13, num_kv_heads, head_dim, dtype)
    expected = cache.clone()
    reshape_and_cache_reference(key, value, expected, 1, slots)
    before = cache.clone()
    reshape_and_cache(key, value, cache, 1, slots)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)
    # The reference really wrote something, and nothing outside layer 1 changed.
    assert not torch.equal(expected[:, 1], before[:, 1])
    torch.testing.assert_close(cache[:, [0, 2]], before[:, [0, 2]], rtol=0, atol=0)


def test_slot_layout(device: torch.device) -> None:
    """Slot s lands at block s // block_size, offset s % block_size; K at index 0, V at 1."""
    key, value, cache, _ = _make(device, 2, 2, 16, torch.float32)
    slots = torch.tensor([BLOCK_SIZE * 3 + 2, BLOCK_SIZE - 1], device=device)
    reshape_and_cache(key, value, cache, 2, slots)
    torch.testing.assert_close(cache[3, 2, 0, 2], key[0], rtol=0, atol=0)
    torch.testing.assert_close(cache[3, 2, 1, 2], value[0], rtol=0, atol=0)
    torch.testing.assert_close(cache[0, 2, 0, BLOCK_SIZE - 1], key[1], rtol=0, atol=0)
    torch.testing.assert_close(cache[0, 2, 1, BLOCK_SIZE - 1], value[1], rtol=0, atol=0)


def test_out_of_range_slot(device: torch.device) -> None:
    """A slot past the cache: the kernel skips it (no stray write), the reference rejects it."""
    key, value, cache, _ = _make(device, 2, 2, 16, torch.float32)
    slots = torch.tensor([NUM_BLOCKS * BLOCK_SIZE, 5], device=device)
    before = cache.clone()
    reshape_and_cache(key, value, cache, 0, slots)
    changed = (cache != before).flatten(1).any(dim=1).nonzero().flatten().tolist()
    assert changed == [5 // BLOCK_SIZE]
    with pytest.raises(ValueError, match="past the cache"):
        reshape_and_cache_reference(key, value, cache, 0, slots)


def test_no_tokens(device: torch.device) -> None:
    """An empty step is a no-op."""
    key, value, cache, slots = _make(device, 0, 2, 16, torch.float32)
    before = cache.clone()
    reshape_and_cache(key, value, cache, 0, slots)
    assert torch.equal(cache, before)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"slot_mapping": torch.zeros(3, dtype=torch.int32)}, "int64"),
        ({"slot_mapping": torch.zeros(2, dtype=torch.int64)}, "slot_mapping must be"),
        ({"key": torch.zeros(3, 2, 8)}, "key must be"),
        ({"value": torch.zeros(3, 2, 16, dtype=torch.float16)}, "value dtype"),
        ({"key": torch.zeros(3, 16, 2).transpose(1, 2)}, "contiguous in head_dim"),
        ({"kv_cache": torch.zeros(2, 1, 3, 4, 2, 16)}, "kv_cache must be"),
        ({"layer": 1}, "layer 1 out of range"),
    ],
)
def test_rejects_bad_inputs(change: dict[str, object], match: str) -> None:
    """Inconsistent shapes, dtypes, strides and layers raise ValueError naming the problem."""
    args: dict[str, object] = {
        "key": torch.zeros(3, 2, 16),
        "value": torch.zeros(3, 2, 16),
        "kv_cache": torch.zeros(2, 1, 2, 4, 2, 16),
        "layer": 0,
        "slot_mapping": torch.zeros(3, dtype=torch.int64),
    }
    args.update(change)
    for fn in (reshape_and_cache, reshape_and_cache_reference):
        with pytest.raises(ValueError, match=match):
            fn(**args)  # type: ignore[arg-type]


def test_compiles_for_hopper(compile_for_hopper: Callable[..., Any]) -> None:
    """The kernel compiles for sm_90 (not just interprets) with bf16 K/V and int64 slots."""
    pointers = {"key_ptr": "bf16", "value_ptr": "bf16", "kv_cache_ptr": "bf16"}
    compile_for_hopper(
        [
            {
                "module": _reshape_and_cache_kernel.__module__,
                "kernel": _reshape_and_cache_kernel.__name__,
                "pointers": pointers | {"slot_mapping_ptr": "i64"},
                "constexprs": {"BLOCK_SIZE": 16, "BLOCK_H": 8, "BLOCK_D": 128},
                "num_warps": 4,
            }
        ]
    )


def test_works_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without triton the module imports, the reference runs, and launching says what is missing."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.find_spec("baton.engine.ops.reshape_and_cache")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    key, value, cache, slots = _make(torch.device("cpu"), 5, 2, 16, torch.float32)
    module.reshape_and_cache_reference(key, value, cache, 0, slots)
    with pytest.raises(RuntimeError, match="needs triton"):
        module.reshape_and_cache(key, value, cache, 0, slots)
