"""What the compatibility fingerprint costs at engine start: the weights' identity
(``baton/engine/compatibility.py``: each safetensors header and three 64-byte samples of every
tensor) against hashing every byte of the checkpoint, side by side in the same run, on a
checkpoint written here with a Llama-like tensor layout, from the page cache (warm) and with the
files' pages dropped first (cold, ``posix_fadvise(DONTNEED)``: no root needed).

    python bench/fingerprint.py [--gib 8] [--layers 32] [--dir /tmp/baton-fp-bench] [--keep]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from baton.engine.compatibility import weights_identity  # noqa: E402

_SHARD_BYTES = 2 << 30  # shards of at most 2 GiB, as hub checkpoints are cut


def write_checkpoint(folder: Path, gib: float, layers: int) -> list[Path]:
    """Float16 shards of `layers` Llama-like layers (9 tensors each) plus embeddings, sized so
    that the whole is about `gib` GiB. Values are constant per tensor: only the layout matters."""
    folder.mkdir(parents=True, exist_ok=True)
    # per layer: q, k, v, o (h*h each, k/v a quarter), gate, up, down (h*3h), two norms
    per_layer = lambda h: (2 * h * h + 2 * h * h // 4 + 3 * h * 3 * h + 2 * h) * 2  # noqa: E731
    hidden = 256
    while per_layer(hidden * 2) * layers <= gib * (1 << 30):
        hidden *= 2
    while per_layer(hidden + 256) * layers <= gib * (1 << 30):
        hidden += 256
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (32000, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        layer: tuple[tuple[str, tuple[int, ...]], ...] = (
            ("self_attn.q_proj.weight", (hidden, hidden)),
            ("self_attn.k_proj.weight", (hidden // 4, hidden)),
            ("self_attn.v_proj.weight", (hidden // 4, hidden)),
            ("self_attn.o_proj.weight", (hidden, hidden)),
            ("mlp.gate_proj.weight", (3 * hidden, hidden)),
            ("mlp.up_proj.weight", (3 * hidden, hidden)),
            ("mlp.down_proj.weight", (hidden, 3 * hidden)),
            ("input_layernorm.weight", (hidden,)),
            ("post_attention_layernorm.weight", (hidden,)),
        )
        for name, shape in layer:
            shapes[p + name] = shape
    files: list[Path] = []
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for n, (name, shape) in enumerate(shapes.items()):
        shard[name] = torch.full(shape, float(n % 100), dtype=torch.float16)
        size += shard[name].numel() * 2
        if size >= _SHARD_BYTES:
            files.append(folder / f"model-{len(files):05d}.safetensors")
            save_file(shard, str(files[-1]))
            shard, size = {}, 0
    if shard:
        files.append(folder / f"model-{len(files):05d}.safetensors")
        save_file(shard, str(files[-1]))
    return files


def full_hash(files: list[Path]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for file in files:
        with open(file, "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
    return h.hexdigest()


def drop_pages(files: list[Path]) -> None:
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn: object, files: list[Path], cold: bool) -> float:
    if cold:
        drop_pages(files)
    start = time.perf_counter()
    fn(files)  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/baton-fp-bench"))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    args = parser.parse_args()
    existing = sorted(args.dir.glob("model-*.safetensors"))
    files = existing or write_checkpoint(args.dir, args.gib, args.layers)
    total = sum(f.stat().st_size for f in files)
    print(f"checkpoint: {total / (1 << 30):.2f} GiB in {len(files)} files, {args.layers} layers")
    try:
        for cold in (False, True):
            fp = min(timed(weights_identity, files, cold) for _ in range(3))
            full = min(timed(full_hash, files, cold) for _ in range(1 if cold else 2))
            label = "cold" if cold else "warm"
            print(
                f"  {label}: weights identity {fp * 1e3:8.1f} ms   hash of every byte "
                f"{full * 1e3:9.1f} ms   ratio {fp / full:.4f}"
            )
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
