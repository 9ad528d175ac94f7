"""Decode attention over the paged KV cache on CPUs, in C (`cpu_paged_attention.c`).

Loaded with ctypes (no torch headers), from one of two places:
- compiled on first use with the system C compiler for this very CPU (``-march=native``) into
  the cache folder (`baton.cache`), where a compiler is found;
- else prebuilt: ``python -m baton.engine.ops.cpu_paged_attention --prebuild DIR`` compiles one
  library per x86-64 microarchitecture level (v2, v3 with AVX2, v4 with AVX-512) at image build
  time, and `$BATON_KERNEL_DIR` names that folder in a runtime image that carries no compiler;
  the highest level this CPU supports is loaded.
Where neither is found, or for caches other than float32 and bfloat16, `available()` is False
and the caller keeps its torch path. `paged_decode_attention_reference` is the torch
implementation the tests compare against.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial
from pathlib import Path

import torch

from baton.cache import cache_dir

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".c")
KERNEL_DIR_ENV = "BATON_KERNEL_DIR"
# Reassociation lets the dot products vectorize. Not -ffast-math: linking with it sets the
# CPU's flush-to-zero mode for the whole process when the library loads.
_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno"]
_FLAGS += ["-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]
_LIMITS = {"group": 16, "head_dim": 256, "block_size": 64}  # MAX_* in the C source
_ENTRY = {
    torch.float32: "paged_decode_attention_f32",
    torch.bfloat16: "paged_decode_attention_bf16",
}
# x86-64 microarchitecture levels, highest first, with the /proc/cpuinfo flags each needs
# beyond the one below it (the psABI's list, cut to the flags that name the level's gain).
_X86_LEVELS = {
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    "x86-64-v3": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe"},
    "x86-64-v2": {"sse4_1", "sse4_2", "ssse3", "popcnt", "cx16"},
}


def _key(march: str) -> str:
    """The library's name for this source, these flags and `march`."""
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + march.encode())
    return f"cpu_paged_attention-{key.hexdigest()[:16]}"


def _compile(compiler: str, march: str, target: Path) -> bool:
    """Compiles the kernel for `march` into `target` (atomically: concurrent engines never load
    half a file); False, with the compiler's complaint logged, when it fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *_FLAGS, f"-march={march}", str(_SOURCE), "-o", str(built), "-lm"],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            logger.warning("compiling %s failed: %s", _SOURCE.name, result.stderr[-2000:])
            return False
        os.replace(built, target)
    return True


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _cpu_levels() -> list[str]:
    """The x86-64 levels this CPU runs, highest first; [] elsewhere."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next(
        (ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []
    )
    have, levels = set(flags), list(_X86_LEVELS)
    # A level needs its own flags and every lower level's.
    return [lv for i, lv in enumerate(levels) if all(_X86_LEVELS[x] <= have for x in levels[i:])]


def _prebuilt() -> Path | None:
    """The best library in `$BATON_KERNEL_DIR` this CPU can run, if any."""
    folder = os.environ.get(KERNEL_DIR_ENV)
    if not folder:
        return None
    for level in _cpu_levels():
        path = Path(folder) / f"{_key(level)}.so"
        if path.exists():
            return path
    logger.warning(
        "%s=%s has no kernel this CPU runs (levels %s)", KERNEL_DIR_ENV, folder, _cpu_levels()
    )
    return None


def prebuild(folder: Path) -> list[Path]:
    """One library per x86-64 level in `folder`, for a runtime image without a compiler."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) to prebuild the CPU attention kernel with")
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"prebuilt kernels are x86-64 only; this is {platform.machine()}")
    built = {level: folder / f"{_key(level)}.so" for level in _X86_LEVELS}
    # One compiler process per level at once: each is single-threaded and takes seconds.
    with ThreadPoolExecutor(len(built)) as pool:
        ok = dict(
            zip(built, pool.map(partial(_compile, compiler), built, built.values()), strict=True)
        )
    failed = [level for level, good in ok.items() if not good]
    if failed:
        raise RuntimeError(f"compiling the CPU attention kernel for {', '.join(failed)} failed")
    return list(built.values())


@cache
def _library() -> ctypes.CDLL | None:
    compiler = _compiler()
    if compiler is not None:
        target = cache_dir() / "kernels" / f"{_key('native' + os.uname().machine)}.so"
        if not target.exists() and not _compile(compiler, "native", target):
            return None
    else:
        prebuilt = _prebuilt()
        if prebuilt is None:
            logger.warning("no C compiler and no prebuilt kernel: CPU decode attention uses torch")
            return None
        target = prebuilt
    lib = ctypes.CDLL(str(target))
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    for fn in (lib.paged_decode_attention_f32, lib.paged_decode_attention_bf16):
        fn.argtypes = [ptr, ptr, i64, i64, ptr, i64, ptr, ptr, i32, i32, i32, i32, i32]
        fn.argtypes += [ctypes.c_float, ctypes.c_float, ptr, i32]
        fn.restype = None
    return lib


def available(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> bool:
    return (
        dtype in _ENTRY
        and num_heads // num_kv_heads <= _LIMITS["group"]
        and head_dim <= _LIMITS["head_dim"]
        and block_size <= _LIMITS["block_size"]
        and _library() is not None
    )


def paged_decode_attention(
    q: torch.Tensor,  # [batch, num_heads, head_dim]
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
    `starts[b]` are never read. A float32 or bfloat16 cache; computed in float32, returned in
    q's dtype."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU attention kernel is not available (no C compiler?)")
    _, num_layers, two, block_size, num_kv_heads, head_dim = kv_cache.shape
    batch, num_heads, q_dim = q.shape
    if two != 2 or q_dim != head_dim or not 0 <= layer < num_layers:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv_cache {tuple(kv_cache.shape)}")
    if kv_cache.dtype not in _ENTRY or not q.dtype.is_floating_point:
        raise ValueError(
            f"the CPU attention kernel takes a float32 or bfloat16 kv_cache, got {kv_cache.dtype}"
        )
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
    dtype = q.dtype
    q = q.to(torch.float32).contiguous()
    seq_lens = seq_lens.contiguous()
    out = torch.empty_like(q)
    layer_view = kv_cache[0, layer]
    getattr(lib, _ENTRY[kv_cache.dtype])(
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
    return out.to(dtype)


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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Prebuild the CPU attention kernel.")
    parser.add_argument("--prebuild", type=Path, required=True, metavar="DIR")
    for path in prebuild(parser.parse_args().prebuild):
        print(path)
