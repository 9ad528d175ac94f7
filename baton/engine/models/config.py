"""What Baton reads from a Hugging Face `config.json`, for the Llama family it supports."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# architecture name -> (q/k/v bias, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "Gemma2ForCausalLM": (False, False),
    "MixtralForCausalLM": (False, False),
    "Qwen3MoeForCausalLM": (False, True),
    "Phi3ForCausalLM": (False, False),
}
# Where transformers gives q/k/v and o_proj a bias by `attention_bias`; Qwen2 always biases
# q/k/v and never o_proj, Mistral and Mixtral never bias. `mlp_bias` is Llama's alone.
_ATTENTION_BIAS_FLAG = (
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(
            f"dtype must be one of auto, {', '.join(sorted(_DTYPES))}; got {name!r}"
        ) from None


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    sliding_window: int | None
    # sliding windows and Gemma 2
    # Per layer: a query at position p attends keys at positions > p - window (None: all).
    layer_windows: tuple[int | None, ...] = ()
    query_pre_attn_scalar: float | None = None  # the softmax scale is its -0.5th power
    attn_logit_softcapping: float | None = None  # scores become cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None
    hidden_activation: str = "silu"
    o_bias: bool = False  # o_proj's bias (Llama, Qwen3, Gemma 2 with `attention_bias`)
    mlp_bias: bool = False  # gate/up/down biases (Llama's `mlp_bias`)
    # mixture of experts (Mixtral, Qwen3-MoE); a dense model keeps the defaults
    num_experts: int = 0  # routed experts in each MoE layer
    num_experts_per_tok: int = 0  # top-k: experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # rescale the top-k routing weights to sum to 1
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is the MoE block; the others are dense

    @property
    def max_positions(self) -> int:
        """The longest sequence the model takes, as vLLM derives it: `max_position_embeddings`,
        times the factor of linear or YaRN rope scaling (YaRN's from the original length);
        llama3 scaling's configs give the stretched length already."""
        scaling = self.rope_scaling
        if scaling is None:
            return self.max_position_embeddings
        kind = rope_type(scaling)
        if kind == "linear":
            return int(self.max_position_embeddings * scaling["factor"])
        if kind == "yarn" and scaling.get("factor"):
            return int(scaling["original_max_position_embeddings"] * scaling["factor"])
        return self.max_position_embeddings

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json")
        cfg = json.loads(config_file.read_text())
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r} in {config_file}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        if arch in _ATTENTION_BIAS_FLAG:
            qkv_bias = bool(cfg.get("attention_bias", False))
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # transformers 5 nests rope settings under `rope_parameters`; 4.x uses two keys.
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or None
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        if scaling is not None and rope_type(scaling) == "default":
            scaling = None
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if partial is not None and float(partial) != 1.0:
            raise ValueError(
                f"partial_rotary_factor {partial} in {config_file} is not supported (rope over "
                "the whole head only)"
            )
        eos = cfg.get("eos_token_id")
        generation_cfg = path / "generation_config.json"
        if generation_cfg.is_file():
            eos = json.loads(generation_cfg.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        sliding = cfg.get("sliding_window")
        # Qwen's configs ignore `sliding_window` unless `use_sliding_window` (transformers too).
        qwen_windowed = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        if qwen_windowed and not cfg.get("use_sliding_window", False):
            sliding = None
        num_layers = cfg["num_hidden_layers"]
        windows = _layer_windows(arch, cfg, sliding, num_layers)
        return cls(
            path=path,
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=qkv_bias and arch in _ATTENTION_BIAS_FLAG,
            mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False)),
            qk_norm=qk_norm,
            eos_token_ids=eos_ids,
            dtype=parse_dtype(str(dtype_name)),
            sliding_window=sliding,
            layer_windows=windows,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            hidden_activation=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            **_moe_fields(arch, cfg),
        )


def rope_type(scaling: dict[str, Any]) -> str:
    """A rope_scaling's kind, under either of its keys (`type` in older configs)."""
    return str(scaling.get("rope_type", scaling.get("type")))


def _layer_windows(
    arch: str, cfg: dict[str, Any], sliding: int | None, num_layers: int
) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers applies it: `layer_types` where the config
    has them (Qwen2, Qwen3, Gemma 2), else the layers from `max_window_layers` on (Qwen2, Qwen3),
    every other layer from the first (Gemma 2), or every layer (Mistral, Mixtral, Qwen3-MoE)."""
    if sliding is None:
        return (None,) * num_layers
    # These families' modeling code ignores layer_types: every layer slides.
    every_layer = (
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
        "Phi3ForCausalLM",
    )
    types = None if arch in every_layer else cfg.get("layer_types")
    if types is None:
        if arch == "Gemma2ForCausalLM":
            types = ["sliding_attention" if i % 2 == 0 else "full" for i in range(num_layers)]
        elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            first = cfg.get("max_window_layers", num_layers)
            types = ["sliding_attention" if i >= first else "full" for i in range(num_layers)]
        else:
            types = ["sliding_attention"] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    return tuple(int(sliding) if t == "sliding_attention" else None for t in types)


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields, as transformers reads them: every Mixtral layer is sparse
    and renormalises its top-k weights; a Qwen3-MoE layer is sparse unless listed in
    `mlp_only_layers` or off the `decoder_sparse_step` stride, and renormalises only with
    `norm_topk_prob`."""
    num_layers = cfg["num_hidden_layers"]
    if arch == "MixtralForCausalLM":
        return dict(
            num_experts=cfg["num_local_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["intermediate_size"],
            norm_topk_prob=True,
            moe_layers=tuple(range(num_layers)),
        )
    if arch == "Qwen3MoeForCausalLM":
        num_experts = cfg.get("num_experts", 0)
        step = cfg.get("decoder_sparse_step", 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        sparse = (i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            moe_layers=tuple(sparse) if num_experts > 0 else (),
        )
    return {}
