"""Resumed answers (`resume_token_ids`, the router's mid-stream migration) against the real
engine server: the single engine's answer T is the oracle. Resumed at a cut k with T[:k], the
text the first stream had sent for T[:k] plus the resumed stream's text is T's text, the resumed
token ids are T[k:], and usage counts the whole answer once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from baton.engine.detokenizer import IncrementalDetokenizer
from baton.engine.sampling_params import resumed_seed
from baton.tokenizer import Tokenizer, load_tokenizer
from tests.engine.api.test_structured_server import SCHEMA
from tests.support.engine_server import MAX_MODEL_LEN, NAME, Server, expect_error

pytestmark = pytest.mark.slow  # the shared server process

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
REPLACEMENT = "\ufffd"
# Prompts whose greedy answers (random tiny weights) are full of byte tokens: some cut lands
# inside a multi-byte character.
# The first has one for completions (cut 20), the second for chat (cut 35).
NON_ASCII = ["😀🎉 emoji 🚀", "ß∂ƒ©˙∆˚¬", "你好，世界。今天天气很好。"]
NUM_TOKENS = 48
GREEDY: dict[str, Any] = {"temperature": 0, "return_token_ids": True}


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Tokenizer:
    return load_tokenizer(model)


@dataclass
class Answer:
    """One choice of a response, whole or gathered from a stream."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: dict[str, Any]
    prompt_token_ids: list[int] | None = None
    chunks: list[dict[str, Any]] = field(default_factory=list)  # the stream's, in order
    # The stream's logprobs: text_offset and token_logprobs of every token it sent.
    offsets: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)

    def sent(self) -> Iterator[tuple[int, str]]:
        """(tokens, text) the client had after each chunk of the stream."""
        tokens, text = 0, ""
        for chunk in self.chunks:
            for choice in chunk["choices"]:
                tokens += len(choice.get("token_ids") or [])
                text += _text_of(choice)
                yield tokens, text


def _text_of(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    if "message" in choice:
        return choice["message"]["content"] or ""
    return choice["text"]


def _ask(server: Server, route: str, body: dict[str, Any]) -> Answer:
    """The answer to `body` (streamed when it says so, with the usage chunk)."""
    body = {"model": NAME, **body}
    if not body.get("stream"):
        resp = httpx.post(f"{server.url}{route}", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        (choice,) = data["choices"]
        prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
        return Answer(
            choice["token_ids"],
            _text_of(choice),
            choice["finish_reason"],
            data["usage"],
            prompt_ids,
        )
    body["stream_options"] = {"include_usage": True}
    chunks = []
    with httpx.stream("POST", f"{server.url}{route}", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    answer = Answer([], "", None, chunks[-1]["usage"], chunks=chunks)
    for chunk in chunks:
        assert "error" not in chunk, chunk
        answer.prompt_token_ids = answer.prompt_token_ids or chunk.get("prompt_token_ids")
        for choice in chunk["choices"]:
            answer.token_ids += choice.get("token_ids") or []
            answer.text += _text_of(choice)
            answer.finish_reason = choice["finish_reason"] or answer.finish_reason
            answer.prompt_token_ids = answer.prompt_token_ids or choice.get("prompt_token_ids")
            if choice.get("logprobs"):
                answer.offsets += choice["logprobs"]["text_offset"]
                answer.logprobs += choice["logprobs"]["token_logprobs"]
    return answer


def _sent_text(tokenizer: Tokenizer, answer: Answer, k: int, holdback: int = 0) -> str:
    """What the single engine's stream had sent once the client had T[:k]: the text its
    detokenizer had made of them (the bytes of an unfinished character held back), less the
    stop strings' holdback."""
    assert answer.prompt_token_ids is not None
    detok = IncrementalDetokenizer(tokenizer, [], True, 0, answer.prompt_token_ids)
    detok.update(answer.token_ids[:k])
    return detok.text[: max(0, len(detok.text) - holdback)]


def _check_oracle(tokenizer: Tokenizer, answer: Answer) -> None:
    """`_sent_text` is what the stream really sent, at every chunk."""
    for k, text in answer.sent():
        if k < len(answer.token_ids):
            assert _sent_text(tokenizer, answer, k) == text, k


def _split_cut(tokenizer: Tokenizer, answer: Answer) -> int | None:
    """A cut inside a multi-byte character that the answer completes: T[:k] decodes to a text
    ending in U+FFFD where T's text has a real character."""
    whole = tokenizer.decode(answer.token_ids, skip_special_tokens=True)
    for k in range(1, len(answer.token_ids)):
        part = tokenizer.decode(answer.token_ids[:k], skip_special_tokens=True)
        done = part.rstrip(REPLACEMENT)
        if part != done and whole.startswith(done) and whole[len(done)] != REPLACEMENT:
            return k
    return None


def _resume(server: Server, route: str, body: dict[str, Any], single: Answer, k: int) -> Answer:
    return _ask(server, route, {**body, "resume_token_ids": single.token_ids[:k]})


def _check_resumed(
    tokenizer: Tokenizer, single: Answer, resumed: Answer, k: int, holdback: int = 0
) -> None:
    """The resumed stream sends exactly what the single one sent after T[:k]."""
    assert _sent_text(tokenizer, single, k, holdback) + resumed.text == single.text, k
    assert resumed.token_ids == single.token_ids[k:], k
    assert resumed.finish_reason == single.finish_reason
    assert resumed.usage["completion_tokens"] == len(single.token_ids)
    assert resumed.usage["prompt_tokens"] == single.usage["prompt_tokens"]
    assert resumed.prompt_token_ids is None  # the first chunk's, sent once


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_resumed_streams_continue_the_single_engines_answer(
    server: Server, tokenizer: Tokenizer, route: str
) -> None:
    """Completions and chat, streamed and whole: at the first token, inside a multi-byte
    character, mid-answer and before the last token, the resumed answer is the single
    engine's: its text and token ids continue exactly, max_tokens counts the whole answer,
    a chat stream opens with no second role chunk, completions' logprobs continue their
    offsets."""
    chosen = None
    for prompt in NON_ASCII:
        body: dict[str, Any] = {**GREEDY, "max_tokens": NUM_TOKENS, "stream": True}
        body["ignore_eos"] = True
        if route == CHAT:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body |= {"prompt": prompt, "logprobs": 1}
        single = _ask(server, route, body)
        split = _split_cut(tokenizer, single)
        if split is not None:
            chosen = body, single, split
            break
    assert chosen is not None, "no answer has a cut inside a multi-byte character"
    body, single, split = chosen
    assert len(single.token_ids) == NUM_TOKENS and single.finish_reason == "length"
    _check_oracle(tokenizer, single)
    for k in sorted({1, split, NUM_TOKENS // 2, NUM_TOKENS - 1}):
        resumed = _resume(server, route, body, single, k)
        _check_resumed(tokenizer, single, resumed, k)
        if route == CHAT:
            assert all("role" not in c["delta"] for ch in resumed.chunks for c in ch["choices"])
        else:
            assert resumed.offsets == single.offsets[k:]
            assert resumed.logprobs == pytest.approx(single.logprobs[k:], abs=1e-3)
    whole = _resume(server, route, {**body, "stream": False}, single, split)
    assert (whole.text, whole.token_ids) == (single.text, single.token_ids)
    assert whole.usage["completion_tokens"] == NUM_TOKENS


def test_a_stop_string_across_the_cut_ends_the_answer_where_the_single_engine_does(
    server: Server, tokenizer: Tokenizer
) -> None:
    """A stop string that starts before the cut and ends after it is found: the resumed
    answer ends where the single engine's does, cut before the stop string."""
    body: dict[str, Any] = {**GREEDY, "prompt": "a b c d", "max_tokens": 32, "ignore_eos": True}
    plain = _ask(server, COMPLETIONS, {**body, "stream": True})
    text = plain.text
    for k in range(2, len(plain.token_ids)):
        cut = len(_sent_text(tokenizer, plain, k))
        stop = text[cut - 2 : cut + 3]
        if cut >= 2 and len(stop) == 5 and text.find(stop) == cut - 2:
            break
    else:
        pytest.fail(f"no stop string straddles a cut of {text!r}")
    body |= {"stop": [stop], "stream": True}
    single = _ask(server, COMPLETIONS, body)
    assert single.finish_reason == "stop" and single.text == text[: cut - 2]
    assert single.token_ids[:k] == plain.token_ids[:k]
    holdback = len(stop) - 1
    resumed = _resume(server, COMPLETIONS, body, single, k)
    _check_resumed(tokenizer, single, resumed, k, holdback)
    assert resumed.chunks[-2]["choices"][0]["stop_reason"] == stop


def test_min_tokens_count_the_whole_answer(server: Server) -> None:
    """min_tokens holds a stop token back until the whole answer, resumed tokens included, is
    long enough: the resumed answer stops where the single engine's does."""
    token = 300
    body = {
        **GREEDY,
        "prompt": "count",
        "max_tokens": 20,
        "min_tokens": 6,
        "stop_token_ids": [token],
        "logit_bias": {str(token): 100},  # the stop token wins whenever it may come
    }
    single = _ask(server, COMPLETIONS, body)
    assert single.finish_reason == "stop" and len(single.token_ids) == 7
    assert single.token_ids[-1] == token and token not in single.token_ids[:-1]
    for k in (2, 5):
        resumed = _resume(server, COMPLETIONS, body, single, k)
        assert resumed.token_ids == single.token_ids and resumed.finish_reason == "stop"
        assert resumed.usage["completion_tokens"] == 7


def test_a_structured_answer_resumed_mid_way_still_follows_its_schema(
    server: Server, tokenizer: Tokenizer
) -> None:
    """The grammar takes the resumed tokens before the next one is masked: the resumed JSON is
    the single engine's and validates; resumed tokens the grammar refuses are a 400."""
    body: dict[str, Any] = {**GREEDY, "prompt": "a colour:", "guided_json": SCHEMA}
    body["max_tokens"] = 200
    single = _ask(server, COMPLETIONS, {**body, "stream": True})
    assert single.finish_reason == "stop", single.text
    jsonschema.validate(json.loads(single.text), SCHEMA)
    n = len(single.token_ids)
    for k in (n // 3, 2 * n // 3):
        resumed = _resume(server, COMPLETIONS, {**body, "stream": True}, single, k)
        _check_resumed(tokenizer, single, resumed, k)
    whole = _resume(server, COMPLETIONS, body, single, n // 2)
    assert whole.text == single.text
    jsonschema.validate(json.loads(whole.text), SCHEMA)
    bad = tokenizer.encode("nope", add_special_tokens=False)
    resp = httpx.post(
        f"{server.url}{COMPLETIONS}",
        json={"model": NAME, **body, "resume_token_ids": bad},
        timeout=60,
    )
    assert "structured outputs" in expect_error(resp, 400)["message"]


def test_a_seeded_answer_resumes_from_a_derived_seed(server: Server) -> None:
    """A seeded sampled answer resumed at the same point twice goes on the same way, sampled
    from the seed `resumed_seed` derives: the same as a new request whose prompt ends with the
    resumed tokens, seeded with it."""
    body: dict[str, Any] = {"prompt": "once upon", "max_tokens": 16, "ignore_eos": True}
    body |= {"temperature": 1.0, "seed": 7, "return_token_ids": True}
    single = _ask(server, COMPLETIONS, body)
    assert single.prompt_token_ids is not None
    k = 5
    first = _resume(server, COMPLETIONS, body, single, k)
    second = _resume(server, COMPLETIONS, body, single, k)
    assert first.token_ids == second.token_ids and first.token_ids[:k] == single.token_ids[:k]
    fresh = _ask(
        server,
        COMPLETIONS,
        {
            **body,
            "prompt": single.prompt_token_ids + single.token_ids[:k],
            "seed": resumed_seed(7, k),
            "max_tokens": 16 - k,
        },
    )
    assert fresh.token_ids == first.token_ids[k:]


def test_penalties_count_the_resumed_tokens(server: Server, tokenizer: Tokenizer) -> None:
    """frequency_penalty counts the resumed tokens as output (not as prompt, which it leaves
    alone): the penalised answer resumed anywhere is the single engine's."""
    body: dict[str, Any] = {**GREEDY, "prompt": "the the the", "max_tokens": 24, "stream": True}
    body["ignore_eos"] = True
    plain = _ask(server, COMPLETIONS, body)
    body |= {"frequency_penalty": 1.0}
    single = _ask(server, COMPLETIONS, body)
    # The first token the penalty changes: resumed just before it, the penalty that changes
    # it falls on resumed tokens only.
    pairs = zip(plain.token_ids, single.token_ids, strict=True)
    first = next(i for i, (a, b) in enumerate(pairs) if a != b)
    for k in sorted({first, 12, 20}):
        _check_resumed(tokenizer, single, _resume(server, COMPLETIONS, body, single, k), k)


def test_what_cannot_be_resumed_is_a_400(server: Server) -> None:
    """Ids outside the vocabulary, n > 1, several prompts, a KV hand-off, no room left by
    max_model_len or max_tokens: each a 400 naming resume_token_ids."""
    base: dict[str, Any] = {"model": NAME, "prompt": "x", "max_tokens": 8, "resume_token_ids": [5]}
    chat: dict[str, Any] = {"model": NAME, "messages": [{"role": "user", "content": "x"}]}
    long_prompt = [5] * (MAX_MODEL_LEN - 10)
    cases: list[tuple[str, dict[str, Any]]] = [
        (COMPLETIONS, {**base, "resume_token_ids": [10**6]}),
        (COMPLETIONS, {**base, "resume_token_ids": [-1]}),
        (COMPLETIONS, {**base, "n": 2}),
        (CHAT, {**chat, "n": 2, "resume_token_ids": [5]}),
        (COMPLETIONS, {**base, "prompt": ["x", "y"]}),
        (COMPLETIONS, {**base, "kv_transfer_params": {"do_remote_decode": True}}),
        (COMPLETIONS, {**base, "resume_token_ids": [5] * 8}),
        (CHAT, {**chat, "max_completion_tokens": 2, "resume_token_ids": [5, 6]}),
        (COMPLETIONS, {**base, "prompt": long_prompt, "max_tokens": 10,
                       "resume_token_ids": [5] * 10}),
    ]  # fmt: skip
    for route, body in cases:
        resp = httpx.post(f"{server.url}{route}", json=body, timeout=60)
        assert expect_error(resp, 400)["param"] == "resume_token_ids", body
