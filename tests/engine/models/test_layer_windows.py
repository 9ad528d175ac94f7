"""Which layers slide, and by how much, read from a config as transformers reads it: transformers'
own config classes are the oracle (their `layer_types` and `sliding_window` after their own
defaults and rules), for every architecture Baton serves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

from baton.engine.models.config import ModelConfig

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)

CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("LlamaForCausalLM", "llama", {}),
    ("MistralForCausalLM", "mistral", {"sliding_window": 16}),
    ("MistralForCausalLM", "mistral", {"sliding_window": None}),
    ("Qwen2ForCausalLM", "qwen2", {"sliding_window": 16}),  # use_sliding_window off
    ("Qwen2ForCausalLM", "qwen2", {"sliding_window": 16, "use_sliding_window": True,
                                   "max_window_layers": 2}),
    ("Qwen3ForCausalLM", "qwen3", {"sliding_window": 4096}),  # off unless use_sliding_window
    ("Qwen3ForCausalLM", "qwen3", {"sliding_window": 16, "use_sliding_window": True,
                                   "max_window_layers": 1}),
    ("Qwen3MoeForCausalLM", "qwen3_moe", {**MOE, "sliding_window": 16}),
    ("Qwen3MoeForCausalLM", "qwen3_moe", {**MOE, "sliding_window": 16, "use_sliding_window": True}),
    ("MixtralForCausalLM", "mixtral", {**MOE, "sliding_window": 16}),
    ("Gemma2ForCausalLM", "gemma2", {"sliding_window": 16, "head_dim": 8}),
    ("Phi3ForCausalLM", "phi3", {"sliding_window": 16, "pad_token_id": 0}),
    ("Phi3ForCausalLM", "phi3", {"sliding_window": None, "pad_token_id": 0}),
]  # fmt: skip


def _transformers_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's window as transformers' attention applies it."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:  # Mistral, Mixtral, Qwen3-MoE: the config's window on every layer
        return (window,) * n
    return tuple(window if t == "sliding_attention" else None for t in types)


@pytest.mark.parametrize(("arch", "model_type", "extra"), CASES)
def test_layer_windows_are_transformers(
    tmp_path: Path, arch: str, model_type: str, extra: dict[str, Any]
) -> None:
    raw = {**BASE, **extra, "architectures": [arch], "model_type": model_type}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    theirs = AutoConfig.from_pretrained(str(tmp_path))
    assert ModelConfig.from_pretrained(tmp_path).layer_windows == _transformers_windows(theirs)
