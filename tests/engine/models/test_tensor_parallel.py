"""Tests for the shard layout: which slice of each weight a tensor-parallel rank holds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from baton.engine.models.config import ModelConfig
from baton.engine.models.tensor_parallel import ShardLayout


def _config(tiny_model, **overrides: int) -> ModelConfig:
    config = ModelConfig.from_pretrained(Path(tiny_model("llama")))
    return dataclasses.replace(config, **overrides)


def test_heads_mlp_and_vocab_split_evenly(tiny_model) -> None:
    """With 4 heads, 2 KV heads and tp 2 each rank holds 2 heads, 1 KV head, half the MLP and
    half the vocabulary, at its own offset."""
    config = _config(tiny_model)
    layouts = [ShardLayout.build(config, r, 2) for r in range(2)]
    assert [(x.num_heads, x.num_kv_heads, x.kv_head_start) for x in layouts] == [
        (2, 1, 0),
        (2, 1, 1),
    ]
    assert [x.intermediate_size for x in layouts] == [64, 64]
    assert [(x.vocab_start, x.vocab_per_rank) for x in layouts] == [(0, 256), (256, 256)]


def test_fewer_kv_heads_than_ranks_are_replicated(tiny_model) -> None:
    """One KV head over 2 ranks: both hold it; 2 KV heads over 4 ranks: pairs share one."""
    one = _config(tiny_model, num_kv_heads=1)
    assert [ShardLayout.build(one, r, 2).kv_head_start for r in range(2)] == [0, 0]
    two = _config(tiny_model, num_kv_heads=2)
    layouts = [ShardLayout.build(two, r, 4) for r in range(4)]
    assert [x.kv_head_start for x in layouts] == [0, 0, 1, 1]
    assert all(x.num_kv_heads == 1 and x.num_heads == 1 for x in layouts)


def test_shards_slice_the_checkpoint(tiny_model) -> None:
    """Column-parallel weights are cut by rows, row-parallel by columns, norms stay whole; the
    vocabulary's last shard stops at the vocabulary's end."""
    config = _config(tiny_model, vocab_size=501)
    hd = config.head_dim  # 16
    r1 = ShardLayout.build(config, 1, 2)
    q = torch.arange(64 * 64.0).view(64, 64)
    assert torch.equal(r1.shard("layers.0.self_attn.q_proj.weight", q, hd), q[32:])
    assert torch.equal(r1.shard("layers.0.self_attn.k_proj.weight", q[:32], hd), q[16:32])
    assert torch.equal(r1.shard("layers.0.self_attn.o_proj.weight", q, hd), q[:, 32:])
    down = torch.arange(64 * 128.0).view(64, 128)
    assert torch.equal(r1.shard("layers.0.mlp.down_proj.weight", down, hd), down[:, 64:])
    up = down.T
    assert torch.equal(r1.shard("layers.0.mlp.up_proj.weight", up, hd), up[64:])
    assert torch.equal(r1.shard("layers.0.input_layernorm.weight", q[0], hd), q[0])
    vocab = torch.zeros(501, 64)
    assert r1.vocab_per_rank == 251 and r1.shard("lm_head.weight", vocab, hd).shape == (250, 64)


@pytest.mark.parametrize(
    ("overrides", "size", "words"),
    [
        ({}, 3, "4 attention heads"),
        ({"num_kv_heads": 3, "num_heads": 6}, 2, "3 KV heads"),
        ({"num_kv_heads": 3, "num_heads": 12}, 4, "3 KV heads cannot be replicated"),
        ({"intermediate_size": 130}, 4, "intermediate_size 130"),
    ],
)
def test_models_that_do_not_split_are_refused(
    tiny_model, overrides: dict[str, int], size: int, words: str
) -> None:
    """A layout that cannot split evenly raises ValueError naming what does not divide."""
    config = _config(tiny_model, **overrides)
    with pytest.raises(ValueError, match=words):
        ShardLayout.build(config, 0, size)
