"""Builds a model from a Hugging Face folder: config, safetensors weights (sharded or not).

Under tensor parallelism each rank reads the whole checkpoint and keeps its slice of every
weight (`ShardLayout.shard`), so no rank ever holds another's shard in device memory.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from baton.engine.models.config import ModelConfig
from baton.engine.models.gemma2 import Gemma2ForCausalLM
from baton.engine.models.llama import LlamaForCausalLM
from baton.engine.models.moe import load_expert_weight, per_expert_keys
from baton.engine.models.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)

# Hugging Face name -> (Baton's fused parameter, which slice of it: index into the parts)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_NAME = re.compile(r"^(?:model\.)?(.*)$")
# Checkpoints that store q/k/v and gate/up fused already (Phi-3): split into the parts above, so
# that sharding and loading take one path.
_STORED_FUSED = re.compile(r"^(.*\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)$")


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files, in load order."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"model folder {path} lacks shards: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        files = sorted(path.glob("*.gguf"))[:1]  # a folder `gguf.prepare` wrote
    if not files:
        raise FileNotFoundError(f"model folder {path} has no *.safetensors weights")
    return files


def _iter_weights(path: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    for file in weight_files(path):
        if file.suffix == ".gguf":
            from baton.engine.models.gguf import iter_weights

            yield from iter_weights(file)
            continue
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield from _unfused(name, f.get_tensor(name), config)


def _unfused(
    name: str, tensor: torch.Tensor, config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """A stored fused q/k/v or gate/up tensor as its parts (rows: q, k, v; gate, up), else the
    tensor as it is."""
    match = _STORED_FUSED.match(name)
    if match is None:
        yield name, tensor
        return
    prefix, module, kind = match.groups()
    if module.endswith("qkv_proj"):
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        if tensor.shape[0] != q + 2 * kv:
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected {q + 2 * kv} rows "
                f"(q {q}, k {kv}, v {kv})"
            )
        parts = zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv]), strict=True)
        for part, piece in parts:
            yield f"{prefix}self_attn.{part}.{kind}", piece
    else:
        for part, piece in zip(("gate_proj", "up_proj"), tensor.chunk(2), strict=True):
            yield f"{prefix}mlp.{part}.{kind}", piece


def load_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    tp: TensorParallel | None = None,
) -> LlamaForCausalLM:
    """Instantiates the model (this rank's shard of it) on `device` in `dtype` and loads every
    weight, or says what is off."""
    model_class = (
        Gemma2ForCausalLM if config.architecture == "Gemma2ForCausalLM" else LlamaForCausalLM
    )
    with torch.device("meta"):
        model = model_class(config, max_positions, tp)
    layout = model.layout
    # Like to_empty(device).to(dtype) without the float32 copy, and without to_empty's path
    # through torch's Python reference ops (its lazy sympy import alone cost ~0.3 s a start).
    model = model._apply(
        lambda t: torch.empty(
            t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device
        )
    )
    if layout.vocab_start + layout.vocab_per_rank > config.vocab_size:
        with torch.no_grad():  # padding rows past the vocabulary: never read, kept finite
            model.embed_tokens.weight.zero_()
            model.lm_head.weight.zero_()
    # Buffers (rope tables) were created on meta, then cast: rebuild them, in float32.
    model.rotary.reset_tables(device)
    if config.tie_word_embeddings:  # _apply made separate tensors: tie them again
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters())
    sizes = {  # this rank's
        "qkv_proj": [
            layout.num_heads * config.head_dim,
            layout.num_kv_heads * config.head_dim,
            layout.num_kv_heads * config.head_dim,
        ],
        "gate_up_proj": [layout.intermediate_size, layout.intermediate_size],
    }
    loaded: set[str] = set()
    for hf_name, tensor in _iter_weights(config.path, config):
        name = _NAME.match(hf_name).group(1)  # type: ignore[union-attr]
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the MoE block
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        tensor = layout.shard(name, tensor, config.head_dim)
        expert_key = load_expert_weight(name, tensor, params, dtype)
        if expert_key is not None:  # one expert's projection, into the stacked parameter
            loaded.add(expert_key)
            continue
        shard = None
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in _FUSED:
                fused, shard = _FUSED[part]
                parts[i] = fused
                break
        target = ".".join(parts)
        param = params.get(target)
        if param is None:
            raise ValueError(f"unexpected weight {hf_name!r} in {config.path}")
        with torch.no_grad():
            dst: torch.Tensor
            if shard is None:
                dst = param
                padded = name.split(".")[0] in ("embed_tokens", "lm_head")
                if padded and 0 < tensor.shape[0] < param.shape[0]:  # the last rank's shard
                    dst = param.narrow(0, 0, tensor.shape[0])
                loaded.add(target)
            else:
                fused_name = parts[i]
                offsets = sizes[fused_name]
                start = sum(offsets[:shard])
                dst = param.narrow(0, start, offsets[shard])
                loaded.add(f"{target}#{shard}")
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor.to(dtype))
    expected: set[str] = set()
    for name in params:
        per_expert = per_expert_keys(name, params[name])
        if per_expert is not None and name not in loaded:  # stored expert by expert
            expected.update(per_expert)
            continue
        fused_into = next(
            (f for f in sizes if name.endswith(f"{f}.weight") or name.endswith(f"{f}.bias")), None
        )
        if fused_into is None:
            expected.add(name)
        else:
            expected.update(f"{name}#{i}" for i in range(len(sizes[fused_into])))
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"model folder {config.path} lacks weights: {', '.join(missing[:8])}")
    model.eval()
    return model
