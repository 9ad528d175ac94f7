"""GGUF checkpoints (llama.cpp's one-file format) as Baton loads them.

A GGUF file holds the model's hyperparameters, its tokenizer and chat template as metadata, and
its weights, most of them quantized. `prepare` turns the metadata into a small Hugging Face
folder in a cache (config.json, generation_config.json, tokenizer.json, tokenizer_config.json
and a link to the file), so that everything that reads a model folder (ModelConfig, the
tokenizer, the compatibility fingerprint) reads this one unchanged; `iter_weights` then reads
the weights from the file itself, dequantized to float32 by the `gguf` package and renamed to
Hugging Face's names, with llama.cpp's reordering of Llama's q/k rows undone.

Parsing a GGUF header (its vocabulary) and dequantizing took about 2 s each per engine start on
SmolLM2-135M, so the prepared folder also keeps what they produce: the weights' identity
(`IDENTITY_FILE`) and, for files whose float32 weights fit in `DEQUANTIZED_MAX_BYTES`, the
dequantized weights as one safetensors file (`DEQUANTIZED_FILE`), written by the first load
while it streams the tensors to the model. Later starts read neither the header nor the
quantized data. Both are derived from the file alone, so an engine that used them and one that
did not agree on the compatibility fingerprint.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from baton.cache import cache_dir, write_once
from baton.engine.models.gguf_tokenizer import tokenizer_config, tokenizer_json

if TYPE_CHECKING:
    from gguf import GGUFReader

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> (Hugging Face architecture, llama.cpp permuted q/k rows)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}
# ggml tensor types dequantized (by gguf.quants.dequantize); checked in tests/engine/models.
SUPPORTED_QUANT_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip


_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    # Llama 3.1-style scaling as llama.cpp stores it: read into the config (`_rope_scaling`);
    # as a weight, skipped by the loader like any rotary buffer.
    "rope_freqs": "model.rotary_emb.freq_factors",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Bumped whenever what `prepare` writes changes, so that older prepared folders are not reused.
_PREPARED_FORMAT = 1
_TENSOR = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)$")


def gguf_file_of(folder: Path) -> Path | None:
    """The GGUF file a folder stands for: its only *.gguf where it has no config.json and no
    safetensors; None for any other folder. Several GGUF files are an error naming them."""
    if (folder / "config.json").exists() or any(folder.glob("*.safetensors")):
        return None
    files = sorted(folder.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ValueError(f"model folder {folder} holds several GGUF files ({names}); pass one")
    return files[0] if files else None


def prepare(file: Path, root: Path | None = None) -> Path:
    """The Hugging Face folder for GGUF `file`, written on first use under `root` (default
    `$BATON_CACHE_DIR/gguf`), keyed by the file's path, size and modification time. The
    folder's name is the file's stem (the default served model name). Unsupported files fail
    here, before any engine starts."""
    file = file.resolve()
    st = file.stat()
    key = hashlib.blake2b(
        f"{_PREPARED_FORMAT}\0{file}\0{st.st_size}\0{st.st_mtime_ns}".encode(), digest_size=8
    ).hexdigest()
    final = (root or cache_dir() / "gguf") / key / file.stem
    if final.is_dir():
        return final

    def write(folder: Path) -> None:
        reader = _reader(file)
        meta = _metadata(reader)
        config = hf_config(meta, reader)
        _write_json(folder / "config.json", config)
        generation: dict[str, Any] = {
            k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config
        }
        _write_json(folder / "generation_config.json", generation)
        (folder / "tokenizer.json").write_text(tokenizer_json(meta), encoding="utf-8")
        _write_json(folder / "tokenizer_config.json", tokenizer_config(meta))
        (folder / file.name).symlink_to(file)

    write_once(final, write)
    logger.info("GGUF %s prepared as the model folder %s", file, final)
    return final


@functools.lru_cache(maxsize=2)
def _cached_reader(file: str, size: int, mtime_ns: int) -> GGUFReader:
    from gguf import GGUFReader

    return GGUFReader(file)


def _reader(file: Path) -> GGUFReader:
    """The file parsed once per process (parsing a vocabulary's metadata takes seconds)."""
    st = file.stat()
    return _cached_reader(str(file.resolve()), st.st_size, st.st_mtime_ns)


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()}


def hf_config(meta: dict[str, Any], reader: GGUFReader) -> dict[str, Any]:
    """config.json's contents for the file's metadata; ValueError for what Baton cannot run."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    _check_tensor_types(reader)
    names = {t.name for t in reader.tensors}

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    config: dict[str, Any] = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch][0]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(get("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": "silu",
        "torch_dtype": _dtype_of(reader),
    }
    scaling = _rope_scaling(get, reader)
    if scaling is not None:
        config["rope_scaling"] = scaling
    for key in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            config[key] = int(meta[f"tokenizer.ggml.{key}"])
    return config


def _rope_scaling(get: Callable[..., Any], reader: GGUFReader) -> dict[str, Any] | None:
    """The config's rope_scaling from the file's `rope.scaling.*` keys: linear, or YaRN with
    its original context and ramp bounds; or, from a `rope_freqs` tensor (Llama 3.1 and later,
    whose llama3 parameters the converter turned into one divisor per frequency),
    `freq_factors`. A YaRN attention factor other than 1 is refused: llama.cpp multiplies it
    into the YaRN scale, which no config field says."""
    from gguf.quants import dequantize

    kind = get("rope.scaling.type")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        if kind not in (None, "none"):
            raise ValueError(f"GGUF with both rope_freqs and rope scaling {kind!r}")
        factors = dequantize(freqs.data, freqs.tensor_type).reshape(-1)
        return {"rope_type": "freq_factors", "factors": [float(f) for f in factors]}
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    if kind == "yarn":
        for key in ("rope.scaling.attn_factor", "rope.scaling.yarn_attn_factor"):
            if float(get(key, 1.0)) != 1.0:
                raise ValueError(f"GGUF YaRN with {key} {get(key)} is not supported")
        scaling: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": float(get("rope.scaling.factor")),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
        }
        for key in ("beta_fast", "beta_slow"):
            if get(f"rope.scaling.yarn_{key}") is not None:
                scaling[key] = float(get(f"rope.scaling.yarn_{key}"))
        return scaling
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported (linear, yarn)")


def _dtype_of(reader: GGUFReader) -> str:
    """The engine dtype `auto` picks: the file's own for F16/BF16 files, else float32 (a
    dequantized block is exact in float32)."""
    types = {t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
    return (
        {"F16": "float16", "BF16": "bfloat16"}.get(types.pop(), "float32")
        if len(types) == 1
        else "float32"
    )


def _check_tensor_types(reader: GGUFReader) -> None:
    bad = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_QUANT_TYPES))
    if bad:
        raise ValueError(
            f"unsupported GGUF quantization type(s) {', '.join(bad)}; supported: "
            f"{', '.join(SUPPORTED_QUANT_TYPES)}"
        )


IDENTITY_FILE = "weights-identity"
DEQUANTIZED_FILE = "dequantized.safetensors.cache"  # not *.safetensors: not a weight file
DEQUANTIZED_MAX_BYTES = 4 << 30


def iter_weights(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of GGUF `file` as (Hugging Face name, float32 tensor): from the prepared
    folder's dequantized copy where there is one, else dequantized, writing that copy."""
    cached = file.parent / DEQUANTIZED_FILE
    if cached.is_file():
        from safetensors import safe_open

        with safe_open(str(cached), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)
        return
    tensors = _dequantize(file)
    if file.is_symlink() and os.access(file.parent, os.W_OK):  # a folder `prepare` wrote
        tensors = _writing_copy(tensors, _tensor_table(file), cached)
    yield from tensors


def _tensor_table(file: Path) -> list[tuple[str, tuple[int, ...]]]:
    """(Hugging Face name, shape) of each tensor, in the file's order."""
    return [
        (hf_name(t.name), tuple(int(n) for n in reversed(t.shape.tolist())))
        for t in _reader(file).tensors
    ]


def _writing_copy(
    tensors: Iterator[tuple[str, torch.Tensor]],
    table: list[tuple[str, tuple[int, ...]]],
    target: Path,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors`, passed through while written to `target` as float32 safetensors (the header
    is known from `table` before any data), renamed in only once every tensor was written."""
    sizes = [4 * int(np.prod(shape)) for _, shape in table]
    if sum(sizes) > DEQUANTIZED_MAX_BYTES:
        yield from tensors
        return
    header: dict[str, Any] = {}
    at = 0
    for (name, shape), size in zip(table, sizes, strict=True):
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [at, at + size]}
        at += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    done = False
    try:
        with open(tmp, "wb") as out:
            out.write(len(head).to_bytes(8, "little") + head)
            for (name, tensor), (want, _) in zip(tensors, table, strict=True):
                if name != want:
                    raise ValueError(f"GGUF tensor {name!r} came where {want!r} was expected")
                out.write(tensor.contiguous().numpy().tobytes())
                yield name, tensor
        os.replace(tmp, target)
        done = True
    finally:
        if not done:
            tmp.unlink(missing_ok=True)


def _dequantize(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    reader = _reader(file)
    meta = _metadata_scalars(reader)
    arch = meta["general.architecture"]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    _check_tensor_types(reader)
    permuted = SUPPORTED_ARCHITECTURES[arch][1]
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    for t in reader.tensors:
        name = hf_name(t.name)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # ggml lists dims fastest first
        array = dequantize(t.data, t.tensor_type).reshape(shape)
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            array = unpermute_rows(array, heads if "q_proj" in name else kv_heads)
        yield name, torch.from_numpy(np.array(array, dtype=np.float32))


def _metadata_scalars(reader: GGUFReader) -> dict[str, Any]:
    """The metadata less its arrays (the vocabulary), which are slow to read."""
    from gguf import GGUFValueType

    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if field.types and field.types[0] != GGUFValueType.ARRAY
    }


def hf_name(name: str) -> str:
    """The Hugging Face name of a GGUF tensor (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`); ValueError for one Baton does not know."""
    m = _TENSOR.match(name)
    table = _LAYER_NAMES if m and m.group(1) is not None else _GLOBAL_NAMES
    if m is None or m.group(2) not in table:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    layer, part, kind = m.groups()
    prefix = "" if layer is None else f"model.layers.{layer}."
    return f"{prefix}{table[part]}.{kind}"


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's row order for Llama's q/k projections: within each head it stores
    the rotary pairs interleaved (0, half, 1, half+1, ...) where Hugging Face stores the two
    halves one after the other."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def weights_identity_update(h: Any, file: Path) -> None:
    """Feeds `h` (a hashlib hash) the identity of the file's weights: a hash of its metadata and
    tensor table (all bytes before the tensor data) and 64 bytes at the start, middle and end of
    every tensor, as `compatibility.weights_identity` reads safetensors. Kept in the prepared
    folder after the first computation."""
    kept = file.parent / IDENTITY_FILE
    if kept.is_file():
        h.update(bytes.fromhex(kept.read_text().strip()))
        return
    digest = _weights_identity(file)
    if file.is_symlink() and os.access(file.parent, os.W_OK):
        tmp = kept.with_name(f".{kept.name}.{os.getpid()}")
        tmp.write_text(digest.hex())
        os.replace(tmp, kept)
    h.update(digest)


def _weights_identity(file: Path) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    reader = _reader(file)
    with open(file, "rb") as f:
        h.update(file.name.encode() + b"\0" + f.read(reader.data_offset))
        fd = f.fileno()
        for t in sorted(reader.tensors, key=lambda t: t.name):
            size = int(t.n_bytes)
            for at in (0, max(0, size // 2 - 32), max(0, size - 64)):
                h.update(os.pread(fd, min(64, size), int(t.data_offset) + at))
    return h.digest()


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
