"""Incremental detokenization equals a full decode (transformers' as the oracle), holds split
characters back until they are whole, keeps the prompt's leading space, and finds stop strings
across tokens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer

from baton.engine.detokenizer import IncrementalDetokenizer
from baton.tokenizer import Tokenizer, load_tokenizer
from tests.engine.tokenizer_folders import smollm2_folder, spiece_folder

UNICODE = "ünïcødé ✓ 漢字 🎉 👩‍👩‍👧 naïve"  # multi-byte characters split over byte tokens


def _folder(request: pytest.FixtureRequest, name: str) -> Path:
    root = request.getfixturevalue("tmp_path_factory").getbasetemp()
    if name == "spiece":
        return spiece_folder(root)
    if name == "smollm2":
        return smollm2_folder(root)
    return Path(request.getfixturevalue("tiny_model")(name))


def _stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Feeds ids in random-sized chunks (1 to 3, as steps deliver them); returns each update's
    new text, then flushes."""
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        before = len(detok.text)
        assert detok.update(ids[i : i + n]) is None
        pieces.append(detok.text[before:])
        i += n
    detok.flush()
    return pieces


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


@pytest.mark.parametrize("name", ["llama", "qwen3", "smollm2"])
@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_stream_equals_transformers_decode(
    request: pytest.FixtureRequest, name: str, skip: bool
) -> None:
    """For byte-level tokenizers the streamed text, seeded with the prompt, equals transformers'
    decode of the generated ids alone: random ids, emoji and special tokens, fed in chunks."""
    folder = _folder(request, name)
    tok, ref = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    rng = random.Random(1)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": UNICODE}], add_generation_prompt=True
    )
    for _ in range(15):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 30))]
        ids += tok.encode(f" {UNICODE} the baton", add_special_tokens=False)
        ids += [rng.randrange(len(tok)) for _ in range(rng.randint(0, 5))]
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip, prompt_token_ids=prompt)
        _stream(detok, ids, rng)
        assert detok.text == ref.decode(ids, skip_special_tokens=skip)
        assert detok.token_ids == ids


def test_byte_fallback_characters_come_out_whole(request: pytest.FixtureRequest) -> None:
    """Characters outside a SentencePiece vocabulary arrive as <0xNN> byte tokens; the text
    grows by whole characters only (never a replacement character), one emoji at a time."""
    tok = load_tokenizer(_folder(request, "spiece"))
    ids = tok.encode(f"the baton {UNICODE}", add_special_tokens=False)
    assert sum(tok.backend.id_to_token(i).startswith("<0x") for i in ids) >= 20
    detok = IncrementalDetokenizer(tok, [])
    pieces: list[str] = []
    for t in ids:
        before = len(detok.text)
        detok.update([t])
        pieces.append(detok.text[before:])
    assert "\ufffd" not in "".join(pieces)
    assert "🎉" in pieces and "漢" in pieces and "字" in pieces
    assert detok.text == tok.decode(ids, skip_special_tokens=True) == f"the baton {UNICODE}"


def test_prompt_seed_keeps_the_leading_space(request: pytest.FixtureRequest) -> None:
    """A SentencePiece decoder strips a text's first space: decoding the completion alone would
    glue "baton" to the prompt. Seeded with the prompt, the stream's text is the completion as
    it reads after the prompt (decode(prompt + out) minus decode(prompt)), as vLLM's is."""
    folder = _folder(request, "spiece")
    tok, ref = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    prompt = tok.encode("The relay passed the")
    rng = random.Random(2)
    for text in ("baton quickly.", f"baton {UNICODE}", "🎉 after a byte token first"):
        out = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, [], prompt_token_ids=prompt)
        _stream(detok, out, rng)
        whole = ref.decode(prompt + out, skip_special_tokens=True)
        assert detok.text == whole[len(ref.decode(prompt, skip_special_tokens=True)) :]
        assert detok.text == " " + ref.decode(out, skip_special_tokens=True)
    unseeded = IncrementalDetokenizer(tok, [])
    unseeded.update(tok.encode("baton", add_special_tokens=False))
    assert unseeded.text == "baton"


def test_flush_emits_an_unfinished_character(tiny_model) -> None:
    """Tokens that end inside a character are held back until flush(), which gives what a full
    decode gives (a replacement character)."""
    tok = load_tokenizer(tiny_model("llama"))
    ids = tok.encode("baton 🎉", add_special_tokens=False)
    cut = ids[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tok, [])
    detok.update(cut)
    assert detok.text == "baton "
    detok.flush()
    assert detok.text == tok.decode(cut) and detok.text.endswith("\ufffd")


def test_invalid_prefix_restarts_the_stream(tiny_model) -> None:
    """When tokenizers' stream rejects its own prefix (seen with some vocabularies), a new
    stream takes over with the held-back tokens, and the text still equals the full decode."""
    tok = load_tokenizer(tiny_model("llama"))
    head = tok.encode("the baton ", add_special_tokens=False)
    emoji = tok.encode("🎉", add_special_tokens=False)
    ids = head + emoji + tok.encode(" passes", add_special_tokens=False)
    fail_at = len(head) + len(emoji)  # the emoji's last byte, its first bytes held back

    class FailsOnce:
        """A DecodeStream that raises tokenizers' invalid-prefix error once."""

        def __init__(self) -> None:
            self.inner, self.calls = DecodeStream(skip_special_tokens=True), 0

        def step(self, backend: object, token: int) -> str | None:
            self.calls += 1
            if self.calls == fail_at:
                raise Exception(
                    f"Invalid prefix encountered while decoding stream. Token ID: {token}"
                )
            return self.inner.step(backend, token)

    detok = IncrementalDetokenizer(tok, [])
    failing = FailsOnce()
    detok._stream = failing  # type: ignore[assignment]
    for t in ids:
        detok.update([t])
    detok.flush()
    assert failing.calls == fail_at and detok._stream is not failing
    assert detok.text == tok.decode(ids) == "the baton 🎉 passes"


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


def test_earliest_stop_in_one_update_wins_and_flush_adds_nothing(tiny_model) -> None:
    """Several tokens in one update: the stop string that starts first ends the text, and a
    flush after a stop leaves it as cut."""
    tok = load_tokenizer(tiny_model("llama"))
    ids = tok.encode("the relay passed the baton 漢字 quickly", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["quickly", "字", "baton"])
    assert detok.update(ids) == "baton"
    detok.flush()
    assert detok.text == "the relay passed the " and detok.stop_reason == "baton"


def test_min_tokens_defers_stop_strings(tiny_model) -> None:
    """Stop strings are not checked before min_tokens tokens have been generated."""
    tok = load_tokenizer(tiny_model("llama"))
    ids = tok.encode("ab ab ab ab", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["ab"], min_tokens=len(ids) + 1)
    assert all(detok.update([t]) is None for t in ids)


def test_special_tokens_skipped_or_shown(tiny_model) -> None:
    """skip_special_tokens hides <|im_end|> from the text, as decode does; off, it shows."""
    tok = load_tokenizer(tiny_model("llama"))
    ids = tok.encode("baton<|im_end|>", add_special_tokens=False)
    for skip, expected in ((True, "baton"), (False, "baton<|im_end|>")):
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        detok.update(ids)
        detok.flush()
        assert detok.text == expected == tok.decode(ids, skip_special_tokens=skip)


def test_seed_skips_an_unclean_prompt_tail(tiny_model) -> None:
    """A prompt given as ids that ends inside a character does not seed the stream (its text
    would not be a prefix of what follows); the text is then the completion's own decode."""
    tok = load_tokenizer(tiny_model("llama"))
    emoji = tok.encode("🎉", add_special_tokens=False)
    assert len(emoji) > 1
    prompt = tok.encode("the baton", add_special_tokens=False) + emoji[:1]
    detok = IncrementalDetokenizer(Tokenizer(tok.backend), [], prompt_token_ids=prompt)
    out = emoji[1:] + tok.encode(" passes", add_special_tokens=False)
    detok.update(out)
    detok.flush()
    assert detok.text == tok.decode(out)
