"""Incremental detokenization equals a full decode; stop strings are found across tokens."""

from __future__ import annotations

import random

from baton.engine.detokenizer import IncrementalDetokenizer
from baton.engine.tokenizer import load_tokenizer


def test_incremental_equals_full_decode(tiny_model) -> None:
    """Feeding random tokens one at a time (split multi-byte characters included) gives the
    same text as decoding them all at once."""
    tok = load_tokenizer(tiny_model("llama"))
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        ids += tok.encode("ünïcødé ✓ 漢字", add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, stop=[])
        for t in ids:
            assert detok.update([t]) is None
        detok.flush()
        assert detok.text == tok.decode(ids, skip_special_tokens=True)


def test_stop_string_spanning_tokens(tiny_model) -> None:
    """A stop string split across several tokens is found and cut from the text."""
    tok = load_tokenizer(tiny_model("llama"))
    ids = tok.encode("the relay passed the baton quickly", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["baton q"])
    found = None
    for t in ids:
        found = detok.update([t]) or found
        if found:
            break
    assert found == "baton q"
    assert detok.text == "the relay passed the "


def test_min_tokens_defers_stop_strings(tiny_model) -> None:
    """Stop strings are not checked before min_tokens tokens have been generated."""
    tok = load_tokenizer(tiny_model("llama"))
    ids = tok.encode("ab ab ab ab", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["ab"], min_tokens=len(ids) + 1)
    assert all(detok.update([t]) is None for t in ids)
