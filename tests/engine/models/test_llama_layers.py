"""The Llama family's norm and rotary embedding against transformers' own modules, bit for bit:
the fused float32 norm and the one-step rotation tables must not change a single rounding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as hf

from baton.engine.models.config import ModelConfig
from baton.engine.models.llama import RMSNorm, RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm_is_transformers_bit_for_bit(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    ours, theirs = RMSNorm(96, 1e-5), hf.LlamaRMSNorm(96, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(96, generator=g))
        theirs.weight.copy_(ours.weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = (torch.randn(rows, 3, 96, generator=g) * 4).to(dtype)  # [tokens, heads, dim], as q_norm
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))


def _config(tmp_path: Path, scaling: dict[str, object] | None) -> tuple[ModelConfig, LlamaConfig]:
    cfg = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "rope_scaling": scaling,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return ModelConfig.from_pretrained(tmp_path), LlamaConfig(**cfg)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
        {"rope_type": "linear", "factor": 4.0},
        {"type": "linear", "factor": 2.5},  # the older key
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        {  # every YaRN field given, no truncation of the ramp
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 16,
            "beta_slow": 2,
            "attention_factor": 1.3,
            "truncate": False,
        },
        {  # DeepSeek's way: the attention factor from mscale / mscale_all_dim
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 100,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
    ],
)
def test_rotation_is_transformers_bit_for_bit(tmp_path: Path, scaling: dict | None) -> None:
    """Queries and keys rotated together, with a step's tables, are transformers'
    `apply_rotary_pos_emb` on its own cos and sin, at scattered positions."""
    config, hf_config = _config(tmp_path, scaling)
    rotary = RotaryEmbedding(config, 4096)
    positions = torch.tensor([0, 1, 17, 511, 512, 3000, 4095])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 4, 32, generator=g) * 3
    k = torch.randn(len(positions), 2, 32, generator=g) * 3
    cos, sin = hf.LlamaRotaryEmbedding(hf_config)(q, positions[None])  # [1, tokens, head_dim]
    want_q, want_k = hf.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    tables = rotary.tables(positions)
    together = rotary.rotate(torch.cat((q, k), dim=1), tables)
    assert torch.equal(together[:, :4], want_q[0].transpose(0, 1))
    assert torch.equal(together[:, 4:], want_k[0].transpose(0, 1))
    assert torch.equal(rotary.rotate(k, tables), want_k[0].transpose(0, 1))


def test_a_bfloat16_rotation_is_computed_in_float32_and_rounded_once(tmp_path: Path) -> None:
    config, _ = _config(tmp_path, None)
    rotary = RotaryEmbedding(config, 4096)
    positions = torch.tensor([3, 900])
    x = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    cos, sin = rotary.cos[positions][:, None], rotary.sin[positions][:, None]
    x1, x2 = x.float().chunk(2, dim=-1)
    want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).bfloat16()
    got = rotary.rotate(x, rotary.tables(positions))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
