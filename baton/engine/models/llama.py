"""The Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3) over Baton's paged KV cache.

One module for all five: they differ only in biases (Qwen2's q/k/v, `attention_bias`,
`mlp_bias`), per-head q/k RMSNorm (Qwen3), an explicit head_dim, tied embeddings, rope settings
and windows, all read from `ModelConfig`, and in how a checkpoint stores q/k/v (Phi-3's fused,
split at load).
Projections are fused (q/k/v into one matmul, gate/up into another): fewer, larger kernels.
Under tensor parallelism each module holds its rank's shard (see `tensor_parallel`).
Mixtral and Qwen3-MoE are Mistral and Qwen3 with a mixture-of-experts MLP (see `moe`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.layers.attention import AttentionBackend, AttentionMetadata
from baton.engine.models.config import ModelConfig, rope_type
from baton.engine.models.moe import SparseMoeBlock
from baton.engine.models.tensor_parallel import ShardLayout, TensorParallel, VocabParallelEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 == self.weight.dtype:
            # The same operations in one call: bit for bit the float32 formula below.
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # fp32 statistics, as transformers computes them, whatever the model dtype.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """The inverse frequencies, and the factor cos and sin are scaled by (YaRN's attention
    factor; 1 for the others), for rope without scaling and with linear, llama3 or YaRN scaling:
    transformers' formulas in float32, in its order of operations (the oracle tests compare
    token for token)."""
    dim = config.head_dim
    steps = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu")
    pos_freqs = config.rope_theta ** (steps / dim)
    inv_freq = 1.0 / pos_freqs
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = rope_type(scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn_frequencies(config, pos_freqs, scaling)
    if kind == "freq_factors":  # a GGUF file's `rope_freqs`: llama.cpp divides by them
        factors = torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
        if factors.shape != inv_freq.shape:
            raise ValueError(f"{len(factors)} rope factors for {len(inv_freq)} frequencies")
        return inv_freq / factors, 1.0
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: linear, llama3, yarn")


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_frequencies(
    config: ModelConfig, pos_freqs: torch.Tensor, scaling: dict
) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): dimensions that turn fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), those that turn more than
    `beta_fast` times kept, a linear ramp between; cos and sin are scaled by the attention
    factor (0.1 ln(factor) + 1 unless the config gives it or `mscale`/`mscale_all_dim`)."""
    dim = config.head_dim
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / old_len
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    base = config.rope_theta

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    half = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = torch.clamp((half - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp  # the share of each dimension kept as it was
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (rotate halves), with a cos/sin table indexed by position.

    A step looks its positions' rows up once (`tables`) and every layer rotates with them:
    `x * [cos, cos] + roll(x, half) * [-sin, sin]`, bit for bit transformers'
    `x * cos + rotate_half(x) * sin` (a negated product added is the product subtracted)."""

    cos: torch.Tensor  # [max_positions, head_dim / 2] float32 buffer
    sin: torch.Tensor

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        # On the host even when the model is built on `meta`: meta arithmetic would import
        # torch's Python decompositions, seconds of start-up for every worker process.
        self.reset_tables(torch.device("cpu"))

    def reset_tables(self, device: torch.device | None = None) -> None:
        """(Re)computes the tables in float32, e.g. after the model was built on `meta`."""
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device or "cpu")
        inv_freq, attention_factor = rope_frequencies(self.config)
        freqs = torch.outer(t, inv_freq.to(device))  # [max_positions, head_dim / 2]
        cos, sin = freqs.cos(), freqs.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The [cos, cos] and [-sin, sin] rows of `positions`: [num_tokens, 1, head_dim]."""
        cos, sin = self.cos[positions], self.sin[positions]
        return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """`x` [num_tokens, heads, head_dim] rotated, in float32, returned in x's dtype."""
        cos, sin = tables
        x32 = x.float()
        return (x32 * cos + x32.roll(x.shape[-1] // 2, -1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary: RotaryEmbedding,
        layout: ShardLayout,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.tp = tp
        self.num_heads = layout.num_heads  # this rank's
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = rotary

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        x: torch.Tensor,  # [num_tokens, hidden]
        kv_cache: torch.Tensor,
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n, hd = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, hd)
        # Once a step: every layer rotates the same positions with the model's one rotary.
        tables = meta.plan.get("rope") or meta.plan.setdefault(
            "rope", self.rotary.tables(positions)
        )
        tables = cast("tuple[torch.Tensor, torch.Tensor]", tables)
        rotate = self.rotary.rotate
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qkv[:, : self.q_size].view(n, self.num_heads, hd))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(n, -1, hd))
            q, k = rotate(q, tables), rotate(k, tables)
        else:  # q and k side by side in qkv: rotated in one go
            qk = rotate(qkv[:, : self.q_size + self.kv_size].view(n, -1, hd), tables)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = attn(q, k, v, kv_cache, self.layer, meta)  # [num_tokens, heads, head_dim]
        return self.tp.all_reduce(self.o_proj(out.view(n, self.q_size)))


# The gate's activation by the config's name (`hidden_act`, Gemma's `hidden_activation`).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


class MLP(nn.Module):
    """Gated MLP (SwiGLU, or GeGLU for Gemma): gate/up fused into one column-parallel matmul,
    down row-parallel, one all-reduce."""

    def __init__(self, config: ModelConfig, layout: ShardLayout, tp: TensorParallel) -> None:
        super().__init__()
        act = ACTIVATIONS.get(config.hidden_activation)
        if act is None:
            raise ValueError(
                f"unsupported activation {config.hidden_activation!r}; "
                f"supported: {', '.join(ACTIVATIONS)}"
            )
        self.act = act
        self.tp = tp
        self.intermediate = layout.intermediate_size  # this rank's
        bias = config.mlp_bias
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.tp.all_reduce(self.down_proj(self.act(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary: RotaryEmbedding,
        layout: ShardLayout,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, rotary, layout, tp)
        # Mixtral and Qwen3-MoE: the MoE block in `config.moe_layers`, the dense MLP elsewhere.
        self.mlp: nn.Module = (
            SparseMoeBlock(config, layout, tp)
            if layer in config.moe_layers
            else MLP(config, layout, tp)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, attn, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    # What a variant (Gemma 2) swaps in: its decoder layer and its final norm.
    layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[nn.Module] = RMSNorm

    def __init__(
        self, config: ModelConfig, max_positions: int, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = tp or TensorParallel()
        self.layout = layout = ShardLayout.build(config, tp.rank, tp.size)
        self.rotary = rotary = RotaryEmbedding(config, max_positions)
        self.embed_tokens = VocabParallelEmbedding(layout, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            self.layer_class(config, i, rotary, layout, tp) for i in range(config.num_layers)
        )
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        # Vocabulary-parallel: each rank scores its rows, `compute_logits` gathers them.
        self.lm_head = nn.Linear(config.hidden_size, layout.vocab_per_rank, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, kv_cache, attn, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # [rows, vocab_per_rank]
        if self.tp.size > 1:  # every rank gets every logit: each samples the same tokens
            logits = self.tp.all_gather(logits)[:, : self.config.vocab_size]
        return logits.float()  # [rows, vocab]
