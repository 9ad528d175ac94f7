"""Decode attention over the paged KV cache on CPUs, in C (`cpu_paged_attention.c`).

Compiled on first use with the system C compiler into a per-user cache folder and loaded with
ctypes: no build step at install time and no torch headers. Where no compiler is found, or
for dtypes other than float32, `available()` is False and the caller keeps its torch path.
`paged_decode_attention_reference` is the torch implementation the tests compare against.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from baton.cache import cache_dir

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".c")
# Reassociation lets the dot products vectorize. Not -ffast-math: linking with it sets the
# CPU's flush-to-zero mode for the whole process when the library loads.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno"]
_FLAGS += ["-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]
_LIMITS = {"group": 16, "head_dim": 256, "block_size": 64}  # MAX_* in the C source


@cache
def _library() -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: CPU decode attention uses the torch path")
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + os.uname().machine.encode())
    target = cache_dir() / "kernels" / f"cpu_paged_attention-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run(
                [compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                logger.warning("compiling %s failed: %s", _SOURCE.name, result.stderr[-2000:])
                return None
            os.replace(built, target)  # atomic: concurrent engines never load half a file
    lib = ctypes.CDLL(str(target))
    fn = lib.paged_decode_attention_f32
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, i64, i64, ptr, i64, ptr, ptr, i32, i32, i32, i32, i32]
    fn.argtypes += [ctypes.c_float, ctypes.c_float, ptr, i32]
    fn.restype = None
    return lib


def available(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> bool:
    return (
        dtype == torch.float32
        and num_heads // num_kv_heads <= _LIMITS["group"]
        and head_dim <= _LIMITS["head_dim"]
        and block_size <= _LIMITS["block_size"]
        and _library() is not None
    )


def paged_decode_attention(
    q: torch.Tensor,  # [batch, num_heads, head_dim] float32
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    layer: int,
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    seq_lens: torch.Tensor,  # [batch] int32
    scale: float,
    *,
    starts: torch.Tensor | None = None,  # [batch] int32 first key attended (sliding window)
    softcap: float | None = None,
) -> torch.Tensor:  # [batch, num_heads, head_dim]
    """One query token per request attending to its context in the paged cache: the keys at
    positions `starts[b]..seq_lens[b] - 1` (all of them without `starts`); blocks wholly before
    `starts[b]` are never read."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU attention kernel is not available (no C compiler?)")
    _, num_layers, two, block_size, num_kv_heads, head_dim = kv_cache.shape
    batch, num_heads, q_dim = q.shape
    if two != 2 or q_dim != head_dim or not 0 <= layer < num_layers:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv_cache {tuple(kv_cache.shape)}")
    if q.dtype != torch.float32 or kv_cache.dtype != torch.float32:
        raise ValueError("the CPU attention kernel takes float32 q and kv_cache")
    if not kv_cache.is_contiguous() or kv_cache.device.type != "cpu":
        raise ValueError("kv_cache must be a contiguous CPU tensor")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError("block_tables and seq_lens must have one row per query")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if starts is not None:
        if starts.dtype != torch.int32 or starts.shape != (batch,):
            raise ValueError("starts must be int32 with one entry per query")
        starts = starts.contiguous()
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")
    q = q.contiguous()
    seq_lens = seq_lens.contiguous()
    out = torch.empty_like(q)
    layer_view = kv_cache[0, layer]
    lib.paged_decode_attention_f32(
        q.data_ptr(),
        layer_view.data_ptr(),
        kv_cache.stride(0),
        kv_cache.stride(2),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        None if starts is None else starts.data_ptr(),
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        softcap or 0.0,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    starts: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The same computation, one request at a time, in plain torch."""
    _, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        blocks = block_tables[b, : -(-n // block_size)].long()
        k = kv_cache[blocks, layer, 0].reshape(-1, num_kv_heads, head_dim)[:n]
        v = kv_cache[blocks, layer, 1].reshape(-1, num_kv_heads, head_dim)[:n]
        k = k.repeat_interleave(group, dim=1).float()  # [n, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1).float()
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if starts is not None:
            scores[:, : int(starts[b])] = float("-inf")
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
