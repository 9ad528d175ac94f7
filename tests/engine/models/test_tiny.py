"""Tests for the deterministic random model writer in baton.engine.models.tiny."""

from __future__ import annotations

import json
import os
import pathlib
import statistics

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from tokenizers import Tokenizer

from baton.engine.models import tiny

SPEC = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=2048,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=2048,
        max_position_embeddings=4096,
    ),
}
FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]


def _config(path: pathlib.Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _shapes(path: pathlib.Path) -> dict[str, tuple[int, ...]]:
    weights = load_file(path / "model.safetensors")
    return {name: tuple(tensor.shape) for name, tensor in weights.items()}


@pytest.mark.parametrize("arch", tiny.ARCHITECTURES)
def test_transformers_loads_every_arch_with_no_missing_weights(tmp_path, arch):
    """transformers loads each tiny arch with no missing/unexpected weights and the spec config."""
    path = tiny.write_tiny_model(tmp_path, arch)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    cfg = model.config
    assert cfg.model_type == arch
    assert type(model).__name__ == cfg.architectures[0]
    assert {k: getattr(cfg, k) for k in SPEC["tiny"]} == SPEC["tiny"]
    assert cfg.tie_word_embeddings == arch.startswith("qwen")
    assert model.dtype == torch.float32
    head_dim = model.model.layers[0].self_attn.head_dim
    assert head_dim == (32 if arch == "qwen3" else 16)
    names = set(_shapes(path))
    assert ("lm_head.weight" in names) != arch.startswith("qwen")
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (arch == "qwen3")


@pytest.mark.parametrize("arch", tiny.ARCHITECTURES)
def test_small_has_exactly_the_specified_dims(tmp_path, arch):
    """The small model's config and weight shapes match the benchmark spec exactly."""
    path = tiny.write_tiny_model(tmp_path, arch, "small")
    cfg = _config(path)
    assert {k: cfg[k] for k in SPEC["small"]} == SPEC["small"]
    head_dim = 64 if arch == "qwen3" else 32
    assert cfg.get("head_dim", 32) == head_dim
    assert "rope_scaling" not in cfg
    shapes = _shapes(path)
    assert shapes["model.embed_tokens.weight"] == (2048, 256)
    if arch == "phi3":  # q, k, v rows stored together, gate and up too
        assert shapes["model.layers.3.self_attn.qkv_proj.weight"] == (16 * head_dim, 256)
        assert shapes["model.layers.3.mlp.gate_up_proj.weight"] == (2 * 688, 256)
    else:
        assert shapes["model.layers.3.self_attn.q_proj.weight"] == (8 * head_dim, 256)
        assert shapes["model.layers.3.self_attn.k_proj.weight"] == (4 * head_dim, 256)
    assert shapes["model.layers.3.mlp.down_proj.weight"] == (256, 688)
    assert "model.layers.4.input_layernorm.weight" not in shapes


def test_writes_are_byte_identical(tmp_path):
    """Same arguments give identical bytes; another seed changes only the weights."""
    a = tiny.write_tiny_model(tmp_path / "a", "qwen2", seed=3)
    b = tiny.write_tiny_model(tmp_path / "b", "qwen2", seed=3)
    c = tiny.write_tiny_model(tmp_path / "c", "qwen2", seed=4)
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("size", tiny.SIZES)
def test_tokenizer_vocab_and_special_ids_match_config(tmp_path, size):
    """The tokenizer has exactly vocab_size tokens and its bos/eos ids agree with both configs."""
    path = tiny.write_tiny_model(tmp_path, "llama", size)
    cfg = _config(path)
    gen = json.loads((path / "generation_config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert (
        len(tok)
        == cfg["vocab_size"]
        == Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    )
    assert tok.bos_token_id == cfg["bos_token_id"] == gen["bos_token_id"]
    assert tok.eos_token_id == cfg["eos_token_id"] == gen["eos_token_id"]
    assert tok.convert_ids_to_tokens(cfg["eos_token_id"]) == "<|im_end|>"


def test_chat_template_renders_chatml(tmp_path):
    """apply_chat_template renders ChatML and appends the assistant header only when asked."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny.write_tiny_model(tmp_path))
    body = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
    assert tok.apply_chat_template(MESSAGES, tokenize=False) == body
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert prompt == body + "<|im_start|>assistant\n"
    ids = tok(prompt)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tok.eos_token_id) == 2


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> Tokenizer:
    path = tiny.write_tiny_model(tmp_path_factory.mktemp("tok"))
    return Tokenizer.from_file(str(path / "tokenizer.json"))


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_tokenizer_round_trips_arbitrary_text(tiny_tokenizer, text):
    """Byte-level BPE encodes then decodes any unicode text back to itself."""
    ids = tiny_tokenizer.encode(text).ids
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("kwargs", [{"arch": "gpt2"}, {"size": "huge"}])
def test_invalid_arch_or_size_raises(tmp_path, kwargs):
    """An unknown arch or size raises ValueError naming the allowed values."""
    allowed = tiny.ARCHITECTURES if "arch" in kwargs else tiny.SIZES
    with pytest.raises(ValueError, match=str(allowed[0])):
        tiny.write_tiny_model(tmp_path, **kwargs)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("arch", tiny.ARCHITECTURES)
def test_tiny_has_under_a_million_params(tmp_path, arch):
    """Every tiny model stays well under one million parameters."""
    shapes = _shapes(tiny.write_tiny_model(tmp_path, arch))
    assert sum(torch.Size(s).numel() for s in shapes.values()) < 1_000_000


def test_rope_scaling_is_written_and_loads(tmp_path):
    """An explicit llama3 rope_scaling lands in config.json and transformers accepts it."""
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    path = tiny.write_tiny_model(tmp_path, "llama", "small", rope_scaling=scaling)
    assert _config(path)["rope_scaling"] == scaling
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert model.config.rope_parameters["rope_type"] == "llama3"


@pytest.mark.parametrize("arch", tiny.ARCHITECTURES)
def test_logits_are_peaky_and_greedy_output_varies(tmp_path, arch):
    """Random prompts give clear top-1 margins and greedy continuations that differ and move on."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny.write_tiny_model(tmp_path, arch))
    gen = torch.Generator().manual_seed(0)
    gaps: list[float] = []
    continuations = set()
    with torch.no_grad():
        for _ in range(6):
            prompt = torch.randint(3, 512, (1, 24), generator=gen)
            logits = model(prompt).logits[0]
            assert torch.isfinite(logits).all()
            top2 = logits.topk(2, dim=-1).values
            gaps += (top2[:, 0] - top2[:, 1]).tolist()
            out = model.generate(
                prompt, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            continuation = tuple(out[0, 24:].tolist())
            assert len(set(continuation)) > 4, continuation
            continuations.add(continuation)
    assert statistics.median(gaps) > 0.1
    assert len(continuations) == 6


def test_default_model_path_is_written_once_and_reused(tmp_path, monkeypatch):
    """default_model_path writes llama-small under BATON_CACHE_DIR once and reuses it after."""
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    first = tiny.default_model_path()
    assert first == tmp_path / "models" / "llama-small"
    assert _config(first)["model_type"] == "llama"
    assert _config(first)["vocab_size"] == 2048
    mtime = os.stat(first / "model.safetensors").st_mtime_ns
    assert tiny.default_model_path() == first
    assert os.stat(first / "model.safetensors").st_mtime_ns == mtime
    assert sorted(p.name for p in first.parent.iterdir()) == ["llama-small"]


def test_default_model_path_uses_the_race_winner(tmp_path, monkeypatch):
    """If another process installs the model first, its copy is kept and the temp dir removed."""
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    final = tmp_path / "models" / "llama-small"
    real_write = tiny.write_tiny_model

    def write_and_lose_race(path, *args, **kwargs):
        real_write(final, "llama", "tiny")  # the other process finishes first
        return real_write(path, *args, **kwargs)

    monkeypatch.setattr(tiny, "write_tiny_model", write_and_lose_race)
    assert tiny.default_model_path() == final
    assert _config(final)["vocab_size"] == 512  # the winner's model, not ours
    assert sorted(p.name for p in final.parent.iterdir()) == ["llama-small"]


def test_bias_flags_follow_transformers(tmp_path):
    """`attention_bias` biases q/k/v and o_proj where transformers reads it (Llama, Qwen3),
    `mlp_bias` is Llama's; Qwen2 biases q/k/v always and o_proj never; Mistral never biases,
    whatever its config says. Every bias the tiny writer adds loads (no weight left over)."""
    from baton.engine.models.config import ModelConfig

    def flags(folder: pathlib.Path) -> tuple[bool, bool, bool]:
        c = ModelConfig.from_pretrained(folder)
        return c.qkv_bias, c.o_bias, c.mlp_bias

    assert flags(tiny.write_tiny_model(tmp_path / "l", "llama", biases=True)) == (True,) * 3
    assert flags(tiny.write_tiny_model(tmp_path / "q3", "qwen3", biases=True)) == (
        True,
        True,
        False,
    )
    assert flags(tiny.write_tiny_model(tmp_path / "q2", "qwen2")) == (True, False, False)
    mistral = tiny.write_tiny_model(tmp_path / "m", "mistral")
    cfg = _config(mistral) | {"attention_bias": True, "mlp_bias": True}
    (mistral / "config.json").write_text(json.dumps(cfg))
    assert flags(mistral) == (False, False, False)
    with pytest.raises(ValueError, match="biases apply to llama and qwen3"):
        tiny.write_tiny_model(tmp_path / "g", "gemma2", biases=True)


def test_a_partial_rotary_factor_is_refused_by_name(tmp_path):
    """Phi-4-mini's rope over three quarters of each head is not built: refused at load, at
    the top level or under transformers 5's `rope_parameters`."""
    from baton.engine.models.config import ModelConfig

    path = tiny.write_tiny_model(tmp_path, "phi3")
    cfg = _config(path)
    for changes in (
        {"partial_rotary_factor": 0.75},
        {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
    ):
        (path / "config.json").write_text(json.dumps(cfg | changes))
        with pytest.raises(ValueError, match="partial_rotary_factor"):
            ModelConfig.from_pretrained(path)
    (path / "config.json").write_text(json.dumps(cfg | {"partial_rotary_factor": 1.0}))
    assert ModelConfig.from_pretrained(path).architecture == "Phi3ForCausalLM"
