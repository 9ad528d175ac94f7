"""What Baton's kernel launchers share: the paged KV cache's checks, tile sizes, and Triton
imported, and the kernels jitted, on first launch rather than at import.

Importing the kernel modules does not import triton (slow, optional on CPU, and
``TRITON_INTERPRET=1`` must be set before triton's first import), and their torch references
work without it. A kernel module declares ``tl: Any = None`` for its kernels' ``tl.*`` names;
:func:`jit` binds it to ``triton.language`` in that module before jitting.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Ints that change from call to call (batch size, layer, cache size) must not be specialised on
# (value 1, multiples of 16): every new combination would compile the kernel again.
_VARYING_ARGS = ("batch", "layer", "num_slots")


@functools.cache
def jit(kernel: Callable[..., None]) -> Any:
    """``kernel`` as a Triton JITFunction, made once (TRITON_INTERPRET is read here).

    RuntimeError, naming the module's torch reference, when triton cannot be imported.
    """
    try:
        import triton
        import triton.language
    except ImportError as e:
        name = kernel.__module__.rsplit(".", 1)[-1]
        raise RuntimeError(
            f"{name} needs triton; install it (pip install triton) or use {name}_reference"
        ) from e
    kernel.__globals__["tl"] = triton.language
    params = inspect.signature(kernel).parameters
    varying = [name for name in _VARYING_ARGS if name in params]
    return triton.jit(kernel, do_not_specialize=varying)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def check_kv_cache(kv_cache: torch.Tensor, layer: int) -> None:
    """ValueError unless ``kv_cache`` is a paged cache the kernels can read and ``layer`` one of
    its layers: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` of a
    supported dtype, contiguous in ``head_dim`` (every other dim is read through its stride)."""
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError(
            "kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    num_layers = kv_cache.shape[1]
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} out of range for a cache with {num_layers} layers")
    if kv_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} not in {SUPPORTED_DTYPES}")
    if kv_cache.stride(5) != 1:
        raise ValueError(
            f"kv_cache must be contiguous in head_dim, got strides {kv_cache.stride()}"
        )
