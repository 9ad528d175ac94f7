"""Gemma 2: the Llama layout with Gemma's own pieces, over Baton's paged KV cache.

What differs from `llama`: RMSNorm scales by (1 + weight); embeddings are multiplied by
sqrt(hidden_size) in the model dtype; each layer has four norms (before and after attention, before
and after the MLP); the MLP is GeGLU (gelu-tanh gate); embeddings are tied; logits are soft-capped.
Attention itself (query scale `query_pre_attn_scalar**-0.5`, score soft-capping, sliding windows
on alternate layers) lives in the attention backend's per-layer `AttentionSpec`.
"""

from __future__ import annotations

import torch
from torch import nn

from baton.engine.layers.attention import AttentionBackend, AttentionMetadata
from baton.engine.models.config import ModelConfig
from baton.engine.models.llama import MLP, Attention, LlamaForCausalLM, RotaryEmbedding
from baton.engine.models.tensor_parallel import ShardLayout, TensorParallel


class GemmaRMSNorm(nn.Module):
    """RMSNorm whose stored weight is an offset from 1; computed in float32, as transformers."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Gemma2DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary: RotaryEmbedding,
        layout: ShardLayout,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, layer, rotary, layout, tp)
        self.mlp = MLP(config, layout, tp)  # GeGLU: the config's gelu-tanh activation
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, attn, meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma2DecoderLayer
    norm_class = GemmaRMSNorm

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.embed_tokens(input_ids)
        # The normaliser is rounded to the model dtype first, as transformers does.
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype, device=x.device)
        for layer in self.layers:
            x = layer(positions, x, kv_cache, attn, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # [rows, vocab_per_rank]
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits)[:, : self.config.vocab_size]
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()  # [rows, vocab]
