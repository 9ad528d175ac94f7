"""Deterministic, randomly initialised Hugging Face model folders for tests and benchmarks.

`write_tiny_model` writes a complete model folder (config, safetensors weights, byte-level BPE
tokenizer with a ChatML chat template, generation config) without touching the network; the same
arguments give byte-identical files on every machine. `default_model_path` caches the benchmark
model (llama, small) on disk.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import pathlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from baton.cache import cache_dir, write_once

# phi3 is llama's layers with q/k/v and gate/up stored fused, as Phi-3 checkpoints store them.
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3")
# Mixture of experts: 4 experts, top-2, each expert half the dense MLP (so 2 active experts match
# it); qwen3_moe keeps layer 0 dense (`mlp_only_layers`) and does not renormalise its top-2.
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")
# Gemma 2: sliding-window layers (even) alternating with global ones, soft-capped scores.
GEMMA_ARCHITECTURES = ("gemma2",)
SIZES = ("tiny", "small")

BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, "<|im_start|>", EOS_TOKEN)  # ids 0, 1, 2
BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 2

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_DIMS: dict[str, dict[str, int]] = {
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
# qwen3 gets an explicit head_dim != hidden_size / num_attention_heads.
_QWEN3_HEAD_DIM = {"tiny": 32, "small": 64}
_ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
_NUM_EXPERTS, _TOP_K = 4, 2

# Init scales. The usual std of 0.02 gives near-uniform logits, so greedy decoding meets near-ties
# and token-for-token comparisons against a reference become flaky. Here embed_tokens and lm_head
# rows have norm ~_LOGIT_STD, so logits have std ~_LOGIT_STD and the top-1 token usually wins by a
# wide margin (median top-1/top-2 gap ~0.8). With tied embeddings the raw input embedding left in
# the residual stream votes for its own token (its self-logit is ~_LOGIT_STD standard deviations
# high), and greedy decoding repeats one token forever; a large MLP output gain makes the residual
# stream mostly token-specific MLP features, which breaks the echo for tied and untied models
# alike. All projections are fan-in scaled, so activations stay O(1) before the gains.
_LOGIT_STD = 4.0
_ATTN_GAIN = 2.0
_MLP_GAIN = 32.0
_NORM_NOISE = 0.05
_BIAS_STD = 0.1
# Router logits with std ~2: clear top-k choices, and routing that differs from token to token.
_ROUTER_STD = 2.0
_GEMMA_QUERY_SCALAR = 24
_GEMMA_ATTN_SOFTCAP = 2.0
_GEMMA_POST_FF_GAIN = 32.0


def write_tiny_model(
    path: str | os.PathLike[str],
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    *,
    rope_scaling: dict[str, Any] | None = None,
    num_key_value_heads: int | None = None,
    sliding_window: int | None = None,
    biases: bool = False,
) -> pathlib.Path:
    """Write a random model folder for (arch, size, seed) to `path` and return it.

    `rope_scaling`, when given, is written verbatim into config.json; `num_key_value_heads`
    overrides the size's (e.g. 1, fewer KV heads than tensor-parallel ranks);
    `sliding_window` sets the window of mistral or phi3 (every layer) or gemma2 (its sliding
    layers);
    `biases` gives llama q/k/v/o and MLP biases (`attention_bias`, `mlp_bias`), qwen3 q/k/v/o.
    """
    known = ARCHITECTURES + MOE_ARCHITECTURES + GEMMA_ARCHITECTURES
    if arch not in known:
        raise ValueError(f"unknown arch {arch!r}; expected one of {known}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = _model_config(arch, size, rope_scaling)
    if num_key_value_heads is not None:
        if config["num_attention_heads"] % num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads {num_key_value_heads} must divide "
                f"num_attention_heads {config['num_attention_heads']}"
            )
        config["num_key_value_heads"] = num_key_value_heads
    if sliding_window is not None:
        if arch not in ("mistral", "gemma2", "phi3"):
            raise ValueError(f"sliding_window applies to mistral, gemma2 and phi3, not {arch!r}")
        config["sliding_window"] = sliding_window
    if biases:
        if arch not in ("llama", "qwen3"):
            raise ValueError(f"biases apply to llama and qwen3, not {arch!r}")
        config["attention_bias"] = True
        config["mlp_bias"] = arch == "llama"
    weights = _random_weights(config, arch, _torch_seed(seed, arch, size))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    (out / "tokenizer.json").write_text(_tokenizer_json(config["vocab_size"]), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", _tokenizer_config(config))
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": BOS_TOKEN_ID},
    )
    return out


def add_args(parser: argparse.ArgumentParser) -> None:
    """`baton tiny-model PATH [--arch A] [--size S] [--seed N]`."""
    parser.add_argument("path")
    parser.add_argument(
        "--arch", choices=ARCHITECTURES + MOE_ARCHITECTURES + GEMMA_ARCHITECTURES, default="llama"
    )
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    path = write_tiny_model(args.path, args.arch, args.size, seed=args.seed)
    print(f"wrote a {args.size} {args.arch} model to {path}")
    return 0


def default_model_path() -> pathlib.Path:
    """Return the cached default model (llama, small), writing it on first use.

    Lives in `$BATON_CACHE_DIR/models/llama-small`, else `~/.cache/baton/models/llama-small`,
    published whole (`baton.cache.write_once`).
    """
    final = cache_dir() / "models" / "llama-small"
    return write_once(final, lambda folder: write_tiny_model(folder, "llama", "small"))


def _model_config(arch: str, size: str, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    qwen = arch.startswith("qwen")
    config: dict[str, Any] = {
        "architectures": [_ARCH_CLASS[arch]],
        "model_type": arch,
        **_DIMS[size],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0 if qwen else 10000.0,
        "tie_word_embeddings": qwen,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if arch == "qwen3":
        config["head_dim"] = _QWEN3_HEAD_DIM[size]
    if arch in ("llama", "qwen3"):
        config["attention_bias"] = False
    if arch == "llama":
        config["mlp_bias"] = False
    if qwen:
        config["use_sliding_window"] = False
        config["sliding_window"] = None
        config["max_window_layers"] = config["num_hidden_layers"]
    if arch == "mistral":
        config["sliding_window"] = None
    if arch == "phi3":  # Phi3Config's default pad id (32000) lies past the tiny vocabularies
        config.update(sliding_window=None, pad_token_id=BOS_TOKEN_ID, resid_pdrop=0.0)
    if arch in MOE_ARCHITECTURES:
        _add_moe_config(config, arch, size)
    if arch == "gemma2":
        _add_gemma2_config(config)
    if rope_scaling is not None:
        config["rope_scaling"] = dict(rope_scaling)
    return config


def _add_moe_config(config: dict[str, Any], arch: str, size: str) -> None:
    expert_inter = _DIMS[size]["intermediate_size"] // _TOP_K
    config.update(num_experts_per_tok=_TOP_K, rope_theta=1000000.0, tie_word_embeddings=False)
    if arch == "mixtral":  # every layer sparse; intermediate_size is the expert's
        config.update(
            intermediate_size=expert_inter,
            num_local_experts=_NUM_EXPERTS,
            router_jitter_noise=0.0,
            sliding_window=None,
        )
    else:
        config.update(
            head_dim=_QWEN3_HEAD_DIM[size],
            attention_bias=False,
            num_experts=_NUM_EXPERTS,
            moe_intermediate_size=expert_inter,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
        )


def _add_gemma2_config(config: dict[str, Any]) -> None:
    layers = config["num_hidden_layers"]
    config.update(
        hidden_act="gelu_pytorch_tanh",
        hidden_activation="gelu_pytorch_tanh",
        head_dim=config["hidden_size"] // config["num_attention_heads"],
        tie_word_embeddings=True,
        attention_bias=False,
        # Unlike head_dim, so that a scale taken from head_dim shows; a small score cap, so
        # that ignoring it shows too.
        query_pre_attn_scalar=_GEMMA_QUERY_SCALAR,
        attn_logit_softcapping=_GEMMA_ATTN_SOFTCAP,
        final_logit_softcapping=30.0,
        sliding_window=4096,
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
        pad_token_id=BOS_TOKEN_ID,
    )


def _to_gemma2(
    w: dict[str, torch.Tensor], config: dict[str, Any], normal: Callable[..., torch.Tensor]
) -> None:
    """Llama's tiny weights made Gemma 2's: norm weights stored as offsets from 1, and the two
    feed-forward norms; the one after the MLP amplifies, as `_MLP_GAIN` does for llama (Gemma's
    post-norms would otherwise undo that gain)."""
    hidden = config["hidden_size"]
    for name in [n for n in w if n.endswith("norm.weight")]:
        w[name] = w[name] - 1.0
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "pre_feedforward_layernorm.weight"] = normal(hidden, std=_NORM_NOISE)
        w[p + "post_feedforward_layernorm.weight"] = (
            _GEMMA_POST_FF_GAIN - 1.0 + normal(hidden, std=_NORM_NOISE)
        )


def _is_moe_layer(config: dict[str, Any], layer: int) -> bool:
    if "num_local_experts" in config:
        return True
    if "num_experts" not in config or layer in config["mlp_only_layers"]:
        return False
    return (layer + 1) % config["decoder_sparse_step"] == 0


def _torch_seed(seed: int, arch: str, size: str) -> int:
    digest = hashlib.sha256(f"{seed}/{arch}/{size}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # fits torch's signed 64-bit seed


def _random_weights(config: dict[str, Any], arch: str, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32, device="cpu") * std

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + normal(dim, std=_NORM_NOISE)

    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    # Same scale as lm_head, which qwen ties to it.
    vocab_std = _LOGIT_STD / math.sqrt(hidden)
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, hidden, std=vocab_std)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        for name, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            w[p + f"self_attn.{name}_proj.weight"] = normal(
                rows * head_dim, hidden, std=1 / math.sqrt(hidden)
            )
            if arch == "qwen2" or config.get("attention_bias"):
                w[p + f"self_attn.{name}_proj.bias"] = normal(rows * head_dim, std=_BIAS_STD)
        w[p + "self_attn.o_proj.weight"] = normal(
            hidden, heads * head_dim, std=_ATTN_GAIN / math.sqrt(heads * head_dim)
        )
        if config.get("attention_bias"):
            w[p + "self_attn.o_proj.bias"] = normal(hidden, std=_BIAS_STD)
        if arch in ("qwen3", "qwen3_moe"):
            w[p + "self_attn.q_norm.weight"] = norm(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(head_dim)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        if _is_moe_layer(config, i):
            w.update(_expert_weights(config, p, normal))
            continue
        w[p + "mlp.gate_proj.weight"] = normal(inter, hidden, std=1 / math.sqrt(hidden))
        w[p + "mlp.up_proj.weight"] = normal(inter, hidden, std=1 / math.sqrt(hidden))
        w[p + "mlp.down_proj.weight"] = normal(hidden, inter, std=_MLP_GAIN / math.sqrt(inter))
        if config.get("mlp_bias"):
            for name, rows in (("gate", inter), ("up", inter), ("down", hidden)):
                w[p + f"mlp.{name}_proj.bias"] = normal(rows, std=_BIAS_STD)
    w["model.norm.weight"] = norm(hidden)
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(vocab, hidden, std=vocab_std)
    if arch == "gemma2":
        _to_gemma2(w, config, normal)
    if arch == "phi3":
        _fuse_phi3(w, config["num_hidden_layers"])
    return w


def _fuse_phi3(w: dict[str, torch.Tensor], num_layers: int) -> None:
    """Phi-3's checkpoint layout: q/k/v rows in one `qkv_proj`, gate then up in `gate_up_proj`."""
    for i in range(num_layers):
        p = f"model.layers.{i}."
        qkv = [w.pop(p + f"self_attn.{name}_proj.weight") for name in ("q", "k", "v")]
        w[p + "self_attn.qkv_proj.weight"] = torch.cat(qkv)
        gate_up = [w.pop(p + f"mlp.{name}_proj.weight") for name in ("gate", "up")]
        w[p + "mlp.gate_up_proj.weight"] = torch.cat(gate_up)


def _expert_weights(
    config: dict[str, Any], prefix: str, normal: Callable[..., torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The router and every expert, under the per-expert names checkpoints on the hub use
    (transformers 5 stacks them on load)."""
    hidden = config["hidden_size"]
    mixtral = "num_local_experts" in config
    block, names = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", _QWEN_PROJ)
    inter = config["intermediate_size"] if mixtral else config["moe_intermediate_size"]
    num_experts = config["num_local_experts"] if mixtral else config["num_experts"]
    p = f"{prefix}{block}."
    w = {p + "gate.weight": normal(num_experts, hidden, std=_ROUTER_STD / math.sqrt(hidden))}
    for e in range(num_experts):
        gate, up, down = (f"{p}experts.{e}.{n}.weight" for n in names)
        w[gate] = normal(inter, hidden, std=1 / math.sqrt(hidden))
        w[up] = normal(inter, hidden, std=1 / math.sqrt(hidden))
        w[down] = normal(hidden, inter, std=_MLP_GAIN / math.sqrt(inter))
    return w


_QWEN_PROJ = ("gate_proj", "up_proj", "down_proj")
_ONSETS: tuple[str, ...] = ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s")
_ONSETS += ("t", "v", "w", "st", "tr", "th", "ch", "sh", "pl", "gr", "br")
_VOWELS = ("a", "e", "i", "o", "u", "ea", "ou", "ai", "io")
_CODAS = ("", "", "n", "r", "s", "t", "l", "nd", "ng", "st", "ck", "tion", "ment", "ly", "er")


def _corpus(num_sentences: int = 4000) -> Iterator[str]:
    """Pseudo-English with Zipf-distributed words: enough distinct merges for 2048 tokens."""
    rng = random.Random(1234)
    lexicon = [
        "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
            for _ in range(rng.randint(1, 3))
        )
        for _ in range(3000)
    ]
    cum_weights = list(itertools.accumulate(1.0 / (i + 1) for i in range(len(lexicon))))
    for _ in range(num_sentences):
        words = rng.choices(lexicon, cum_weights=cum_weights, k=rng.randint(4, 14))
        words[0] = words[0].capitalize()
        tail = f" {rng.randint(0, 9999)}" if rng.random() < 0.2 else ""
        yield " ".join(words) + rng.choice(".,?!.") + tail


def _tokenizer_json(vocab_size: int) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"BPE training gave {tok.get_vocab_size()} tokens, not {vocab_size}")
    return tok.to_str(pretty=True)


def _tokenizer_config(config: dict[str, Any]) -> dict[str, Any]:
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": BOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: pathlib.Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
