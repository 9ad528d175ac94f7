"""A GGUF file's tokenizer as `tokenizers` builds it: tokenizer.json and tokenizer_config.json
for the folder `gguf.prepare` writes, from the vocabulary, merges, token types and chat template
in the file's metadata. Byte-level BPE (`gpt2`, with llama.cpp's pre-tokenizer regexes) and
SentencePiece BPE with byte fallback (`llama`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from baton.tokenizer import byte_level_spelling

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

# llama.cpp's `tokenizer.ggml.pre` -> the regex that splits text before byte-level BPE; None:
# GPT-2's own split (ByteLevel's regex). "digits": each digit alone, then GPT-2's split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_PRE_TOKENIZERS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "llama3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


def tokenizer_json(meta: dict[str, Any]) -> str:
    """tokenizer.json for the file's vocabulary; ValueError for a kind Baton cannot build."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level_tokenizer(meta)
    elif kind == "llama":
        tokenizer = _sentencepiece_tokenizer(meta)
    else:
        raise ValueError(
            f"unsupported GGUF tokenizer {kind!r}; supported: gpt2 (byte-level BPE), "
            "llama (SentencePiece BPE with byte fallback)"
        )
    return str(tokenizer.to_str())


def _byte_level_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(_PRE_TOKENIZERS)}"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    spelling = byte_level_spelling()
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    split = _PRE_TOKENIZERS[pre]
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=split in (None, "digits")
    )
    if split is None:
        tokenizer.pre_tokenizer = byte_level
    elif split == "digits":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a mislabel in the file (it is not in
    # the vocabulary as written) and is left out.
    _add_file_tokens(tokenizer, meta, lambda t: set(t) <= alphabet)
    return tokenizer


def _sentencepiece_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """llama.cpp's `llama` vocabulary (SentencePiece BPE, as Llama 2 and Mistral have): "▁" for
    a space and before the text, `<0xNN>` tokens for bytes outside the vocabulary. The merges are
    the file's, or else those its scores imply (as transformers derives them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    elif "tokenizer.ggml.scores" in meta:
        merges = _merges_from_scores(
            vocab, dict(zip(tokens, meta["tokenizer.ggml.scores"], strict=True))
        )
    else:
        raise ValueError("GGUF llama tokenizer has neither tokenizer.ggml.scores nor merges")
    if meta.get("tokenizer.ggml.add_space_prefix") is False:
        # Ignored, as transformers' GGUF reader ignores it: Baton tokenizes as transformers does.
        logger.warning("GGUF tokenizer.ggml.add_space_prefix = false is not applied")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    # "first": the space goes before the text's first piece only, not after each special token.
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    _add_file_tokens(tokenizer, meta, lambda t: True)
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges for a vocabulary that has scores instead: every split of a token into two
    tokens is a merge ranked by the whole token's score (higher first), ties broken by the
    longer left then right piece, then by the token's place and the pieces' ids."""
    ranked: list[tuple[float, int, int, int, int, int, str, str]] = []
    for place, (token, score) in enumerate(scores.items()):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                key = (-score, -len(left), -len(right), place, vocab[left], vocab[right])
                ranked.append((*key, left, right))
    ranked.sort(key=lambda r: r[:6])
    return [(r[6], r[7]) for r in ranked]


def _add_file_tokens(
    tokenizer: Tokenizer, meta: dict[str, Any], keep: Callable[[str], bool]
) -> None:
    """The file's control tokens as special added tokens and its user-defined ones as plain
    added tokens, both matched whole in the raw text (llama.cpp never splits them)."""
    from tokenizers import AddedToken

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = tokenizer.get_vocab()
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind == _CONTROL and keep(t)
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind == _USER_DEFINED and t in vocab
        ]
    )


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens, BOS/EOS framing and the chat template."""
    tokens = meta["tokenizer.ggml.tokens"]
    sentencepiece = meta.get("tokenizer.ggml.model") == "llama"
    config: dict[str, Any] = {
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", sentencepiece)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            config[name] = tokens[int(token_id)]
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config
