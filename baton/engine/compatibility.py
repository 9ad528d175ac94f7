"""The engine's compatibility fingerprint (``baton/kv_transfer/fingerprint.py``), computed at start
from the model folder, the tokenizer folder and what the engine resolved (dtype, block shape,
tensor-parallel split). Reads files only: no tensor is loaded for it.

The weights' identity is what costs on a large checkpoint, so it hashes what changes with any
new revision without reading the whole file: each safetensors file's header whole (every tensor's
name, dtype, shape and offsets: a re-quantized, pruned or re-shaped checkpoint differs there) and,
of every tensor, 64 bytes at its start, middle and end (a re-trained or fine-tuned tensor differs
in practically every byte, so any tensor that changed changes its samples). That is a few hundred
bytes read per tensor whatever the checkpoint's size. What it misses: an edit confined to bytes no
sample covers (one row of one matrix), which no checkpoint revision in practice is; the file sizes
are in the header's offsets.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from baton.kv_transfer.fingerprint import Fingerprint
from baton.tokenizer import chat_template_of

_SAMPLE_BYTES = 64
# config.json keys that say how a file was written, not what the model computes
_CONFIG_BOOKKEEPING = ("_name_or_path", "transformers_version", "architectures_version")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _short(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def model_identity(model_path: Path) -> str:
    config = json.loads((model_path / "config.json").read_text(encoding="utf-8"))
    for key in _CONFIG_BOOKKEEPING:
        config.pop(key, None)
    return _short(_canonical(config))


def weights_identity(files: Iterable[Path]) -> str:
    """See the module docstring: each safetensors header, and three samples of every tensor."""
    h = hashlib.blake2b(digest_size=8)
    for file in files:
        if file.suffix == ".gguf":  # the same, from the GGUF file's own header
            from baton.engine.models.gguf import weights_identity_update

            weights_identity_update(h, file)
            continue
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = f.read(header_len)
            h.update(file.name.encode() + b"\0" + header)
            base = 8 + header_len
            tensors = json.loads(header)
            fd = f.fileno()
            for name in sorted(k for k in tensors if k != "__metadata__"):
                start, end = tensors[name]["data_offsets"]
                size = end - start
                for at in (0, max(0, size // 2 - _SAMPLE_BYTES // 2), max(0, size - _SAMPLE_BYTES)):
                    h.update(os.pread(fd, min(_SAMPLE_BYTES, size), base + start + at))
    return h.hexdigest()


def tokenizer_identity(tokenizer_path: Path, chat_template: str | None = None) -> tuple[str, str]:
    """(the tokenizer's files, less any chat template in them; the chat template as the server
    reads it) as hashes."""
    h = hashlib.blake2b(digest_size=8)
    for name in _TOKENIZER_FILES:
        path = tokenizer_path / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if name == "tokenizer_config.json":
            config = json.loads(data)
            config.pop("chat_template", None)
            data = _canonical(config)
        h.update(name.encode() + b"\0" + data)
    return h.hexdigest(), _short(_canonical(chat_template_of(tokenizer_path, chat_template)))


def compute(
    model_path: Path,
    tokenizer_path: Path,
    weight_files: Iterable[Path],
    *,
    dtype: str,
    kv_cache_dtype: str,
    block_size: int,
    block_shape: tuple[int, ...],
    tensor_parallel_size: int,
    chat_template: str | None = None,
) -> Fingerprint:
    """The engine's fingerprint; `block_shape` is one rank's KV block, without the block axis;
    `chat_template` the engine's own, when it replaces the tokenizer's."""
    tokenizer, template = tokenizer_identity(tokenizer_path, chat_template)
    return Fingerprint(
        model=model_identity(model_path),
        weights=weights_identity(weight_files),
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=str(block_size),
        kv_layout="x".join(map(str, block_shape)) + f"/tp{tensor_parallel_size}",
        tokenizer=tokenizer,
        chat_template=template,
    )
