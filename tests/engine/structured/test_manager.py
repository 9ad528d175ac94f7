"""The StructuredOutputManager as the scheduler drives it: compiles off the caller's thread,
batch bitmasks (all-ones rows for unconstrained requests, parallel fill equal to one by one),
random walks through the batch that validate, after_token_ids activation, rejection, completion,
failures and the logits' width."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from baton.engine.models.tiny import EOS_TOKEN_ID
from baton.engine.sampling_params import StructuredOutputsParams
from baton.engine.structured import manager as manager_module
from baton.engine.structured.backend import Grammar, GrammarCompiler
from baton.engine.structured.manager import StructuredOutputManager
from baton.tokenizer import Tokenizer, load_tokenizer
from tests.engine.structured.walk import allowed_ids

VOCAB = 520  # the tiny tokenizer has 512 tokens; the logits are padded
WORDS = (VOCAB + 31) // 32

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["id", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,5}(-[0-9]{1,2})?"
CHOICES = ("red", "green", "blue")


@pytest.fixture(scope="module")
def tok(tiny_model: Callable[..., Path]) -> Tokenizer:
    return load_tokenizer(tiny_model("llama"))


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tok, VOCAB, [EOS_TOKEN_ID], any_whitespace=False)


@pytest.fixture
def manager(compiler: GrammarCompiler) -> Iterator[StructuredOutputManager]:
    m = StructuredOutputManager(compiler)
    yield m
    m.close()


def wait_ready(manager: StructuredOutputManager, *ids: str) -> None:
    deadline = time.monotonic() + 30
    while not all(manager.is_ready(i) for i in ids):
        assert time.monotonic() < deadline, "compiles did not finish"
        time.sleep(0.005)


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_batch_walk_validates(manager: StructuredOutputManager, tok: Tokenizer) -> None:
    """A batch of json, regex and choice requests and an unconstrained one, stepped together
    through `bitmask` and `accept` with uniform draws among allowed tokens: each constrained
    output is valid, the unconstrained row is all ones throughout."""
    params = {
        "json": StructuredOutputsParams(json=json.dumps(SCHEMA)),
        "regex": StructuredOutputsParams(regex=REGEX),
        "choice": StructuredOutputsParams(choice=CHOICES),
    }
    for rounds in range(3):
        for name, p in params.items():
            manager.add_request(f"{name}-{rounds}", p)
    batch = [f"{name}-{r}" for r in range(3) for name in params] + ["free"]
    wait_ready(manager, *batch)
    rng = random.Random(0)
    outputs: dict[str, list[int]] = {r: [] for r in batch[:-1]}
    live = list(batch)
    for _ in range(300):
        mask = manager.bitmask(live)
        assert mask is not None and mask.shape == (len(live), WORDS) and mask.dtype == np.int32
        assert (mask[live.index("free")] == -1).all()
        for row, request_id in zip(mask, list(live), strict=True):
            if request_id == "free":
                continue
            allowed = allowed_ids(row, VOCAB).tolist()
            assert allowed and max(allowed) < 512
            others = [t for t in allowed if t != EOS_TOKEN_ID]
            may_end = len(others) < len(allowed)
            end = not others or (may_end and rng.random() < 0.2)
            token = EOS_TOKEN_ID if end else rng.choice(others)
            assert manager.accept(request_id, token)
            if token == EOS_TOKEN_ID:
                assert manager.is_terminated(request_id)
                manager.remove(request_id)
                live.remove(request_id)
            else:
                outputs[request_id].append(token)
        if live == ["free"]:
            break
    assert live == ["free"], f"walks did not end: {live}"
    assert manager.bitmask(["free"]) is None
    for request_id, out in outputs.items():
        text = tok.decode(out)
        if request_id.startswith("json"):
            jsonschema.validate(json.loads(text), SCHEMA)
        elif request_id.startswith("regex"):
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in CHOICES


def test_parallel_fill_equals_one_by_one(
    compiler: GrammarCompiler, tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The executor's parallel fill gives the rows that filling one matcher at a time gives,
    in the right rows, with unconstrained rows between them left all ones."""
    masks = []
    for threshold in (1, 10**9):
        monkeypatch.setattr(manager_module, "PARALLEL_FILL_MIN_ROWS", threshold)
        m = StructuredOutputManager(compiler)
        kinds = [
            StructuredOutputsParams(json=json.dumps(SCHEMA)),
            StructuredOutputsParams(regex=REGEX),
            StructuredOutputsParams(choice=CHOICES),
            StructuredOutputsParams(json_object=True),
            StructuredOutputsParams(regex="[0-9]+"),
        ]
        for i, p in enumerate(kinds):
            m.add_request(f"r{i}", p)
        m.accept("r0", ids_of(tok, "{")[0])
        wait_ready(m, *(f"r{i}" for i in range(len(kinds))))
        masks.append(m.bitmask(["a", "r0", "r1", "b", "r2", "r3", "r4"]))
        m.close()
    assert masks[0] is not None and masks[1] is not None
    np.testing.assert_array_equal(masks[0], masks[1])
    assert (masks[0][[0, 3]] == -1).all()
    assert not (masks[0][[1, 2, 4, 5, 6]] == -1).all(axis=1).any()


def test_after_token_ids_activate_the_constraint(
    manager: StructuredOutputManager, tok: Tokenizer
) -> None:
    """Until the output ends with after_token_ids (the end of the reasoning) the row is all
    ones and tokens are not fed to the grammar; from the next token on the grammar rules."""
    end = ids_of(tok, "</think>")
    assert len(end) > 1
    manager.add_request("r", StructuredOutputsParams(regex="[0-9]+", after_token_ids=tuple(end)))
    wait_ready(manager, "r")
    thinking = ids_of(tok, "hmm, </thi so") + end[:-1] + ids_of(tok, " x") + end
    for t in thinking:
        assert manager.bitmask(["r"]) is None
        assert manager.accept("r", t)  # text the grammar would refuse, not fed to it
    mask = manager.bitmask(["r"])
    assert mask is not None
    allowed = set(allowed_ids(mask[0], VOCAB).tolist())
    assert ids_of(tok, "7")[0] in allowed and ids_of(tok, "a")[0] not in allowed
    assert manager.accept("r", ids_of(tok, "7")[0])
    assert not manager.accept("r", ids_of(tok, "a")[0])


def test_rejection_and_completion(manager: StructuredOutputManager, tok: Tokenizer) -> None:
    """A token outside the mask is rejected and leaves only EOS; a complete grammar is
    terminated, allows only EOS and accepts it."""
    manager.add_request("bad", StructuredOutputsParams(choice=("yes", "no")))
    manager.add_request("done", StructuredOutputsParams(choice=("yes", "no")))
    wait_ready(manager, "bad", "done")
    assert not manager.accept("bad", ids_of(tok, "maybe")[0])
    assert not manager.is_terminated("bad")
    mask = manager.bitmask(["bad", "done"])
    assert mask is not None
    assert allowed_ids(mask[0], VOCAB).tolist() == [EOS_TOKEN_ID]
    assert EOS_TOKEN_ID not in allowed_ids(mask[1], VOCAB)
    for t in ids_of(tok, "yes"):
        assert not manager.is_terminated("done")
        assert manager.accept("done", t)
    assert manager.is_terminated("done")
    mask = manager.bitmask(["done"])
    assert mask is not None and allowed_ids(mask[0], VOCAB).tolist() == [EOS_TOKEN_ID]
    assert not manager.accept("done", ids_of(tok, "s")[0])
    assert manager.accept("done", EOS_TOKEN_ID)
    assert manager.is_terminated("done")


def test_n_requests_have_their_own_matchers(
    manager: StructuredOutputManager, compiler: GrammarCompiler, tok: Tokenizer
) -> None:
    """Requests with equal params (n > 1) share one compile but advance separately."""
    params = StructuredOutputsParams(choice=CHOICES)
    manager.add_request("a", params)
    manager.add_request("b", params)
    wait_ready(manager, "a", "b")
    for t in ids_of(tok, "red"):
        assert manager.accept("a", t)
    assert manager.is_terminated("a") and not manager.is_terminated("b")
    for t in ids_of(tok, "blue"):
        assert manager.accept("b", t)
    assert compiler.compile(params) is compiler.compile(params)


def test_a_failed_compile_is_an_error(manager: StructuredOutputManager) -> None:
    """A grammar that does not compile makes the request ready with the reason as its error;
    it constrains nothing."""
    manager.add_request("r", StructuredOutputsParams(regex="(unclosed"))
    manager.add_request("ok", StructuredOutputsParams(regex="a"))
    wait_ready(manager, "r", "ok")
    error = manager.error("r")
    assert error is not None and error.startswith("structured_outputs.regex:"), error
    assert manager.error("ok") is None and manager.error("unknown") is None
    assert manager.bitmask(["r"]) is None
    assert not manager.accept("r", 5)


def test_compiles_off_the_callers_thread(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """add_request returns while the grammar compiles; is_ready turns true when it is done;
    a request removed meanwhile is forgotten."""
    release = threading.Event()
    real = GrammarCompiler.compile

    def slow(self: GrammarCompiler, params: StructuredOutputsParams) -> Grammar:
        assert threading.current_thread() is not threading.main_thread()
        release.wait(10)
        return real(self, params)

    monkeypatch.setattr(GrammarCompiler, "compile", slow)
    m = StructuredOutputManager(compiler)
    try:
        start = time.monotonic()
        m.add_request("r", StructuredOutputsParams(regex="[0-9]"))
        m.add_request("gone", StructuredOutputsParams(regex="[0-9]"))
        assert time.monotonic() - start < 1.0
        assert not m.is_ready("r") and m.error("r") is None
        m.remove("gone")
        release.set()
        wait_ready(m, "r")
        assert m.bitmask(["r", "gone"]) is not None
        with pytest.raises(ValueError, match="already"):
            m.add_request("r", StructuredOutputsParams(regex="x"))
    finally:
        m.close()


def test_logits_narrower_than_the_tokenizer(tok: Tokenizer) -> None:
    """With fewer logits than tokens, the mask is as wide as the logits and allows no id past
    them."""
    compiler = GrammarCompiler(tok, 500, [EOS_TOKEN_ID])
    m = StructuredOutputManager(compiler)
    try:
        m.add_request("r", StructuredOutputsParams(regex="(.|\n)*"))
        wait_ready(m, "r")
        mask = m.bitmask(["r", "free"])
        assert mask is not None and mask.shape == (2, 16)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")
        assert bits[500:].sum() == 0 and bits[:500].sum() > 400
    finally:
        m.close()
