"""The OpenAI wire format's response side without an engine: logprob shapes, the stream cursor's
stop-string holdback, and server-sent event chunks."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from baton.engine.api import responses as r
from baton.engine.outputs import CompletionOutput, Logprob

# ---- logprobs and streaming shapes ---------------------------------------------------------


def _entry(sampled: int, *alts: int) -> dict[int, Logprob]:
    entry = {sampled: Logprob(-0.5, 1, chr(sampled))}
    for rank, t in enumerate(alts, start=2):
        entry[t] = Logprob(-0.5 * rank, rank, chr(t))
    return entry


def test_completion_logprobs_shape() -> None:
    """Legacy logprobs: tokens, token_logprobs, top_logprobs and text offsets that accumulate."""
    ids = [ord("a"), ord("b")]
    lp, end = r.completion_logprobs(
        ids, [None, _entry(ord("b"), ord("c"))], 1, text_offset=5, decode=chr
    )
    assert lp.tokens == ["a", "b"] and lp.text_offset == [5, 6] and end == 7
    assert lp.token_logprobs == [None, -0.5]
    assert lp.top_logprobs == [None, {"b": -0.5}]


def test_chat_logprobs_shape() -> None:
    """Chat logprobs: per token its logprob, UTF-8 bytes and the k most likely, best first."""
    lp = r.chat_logprobs([ord("b")], [_entry(ord("b"), ord("c"), ord("d"))], 2, decode=chr)
    assert lp.model_dump() == {
        "content": [
            {
                "token": "b",
                "logprob": -0.5,
                "bytes": [98],
                "top_logprobs": [
                    {"token": "b", "logprob": -0.5, "bytes": [98]},
                    {"token": "c", "logprob": -1.0, "bytes": [99]},
                ],
            }
        ]
    }


def test_chat_logprob_bytes_of_a_split_character_join_into_it(tiny_model) -> None:
    """A character split over tokens: each token's text is U+FFFD, but its `bytes` are its own,
    so the bytes of the answer's tokens join into the character (OpenAI's meaning); the top
    alternatives' too."""
    from baton.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model("qwen2"))
    ids = tok.encode("🙂!", add_special_tokens=False)
    assert len(ids) > 2  # the emoji is split
    entries = [{t: Logprob(-0.1, 1, tok.decode([t]))} for t in ids]
    lp = r.chat_logprobs(ids, entries, 1, lambda t: tok.decode([t]), tok.token_bytes)
    content = lp.model_dump()["content"]
    assert b"".join(bytes(c["bytes"]) for c in content) == "🙂!".encode()
    assert [c["top_logprobs"][0]["bytes"] for c in content] == [c["bytes"] for c in content]
    assert content[0]["token"] == "\ufffd"
    plain = r.chat_logprobs(ids, entries, 1, lambda t: tok.decode([t]))  # the text's bytes
    assert plain.model_dump()["content"][0]["bytes"] == list("\ufffd".encode())


def test_cursor_holds_back_a_possible_stop_string() -> None:
    """While a sample runs, text that may start a stop string stays unsent; at the end all goes."""
    cursor = r.SampleCursor(holdback=r.stop_holdback(["abc"]))
    running = CompletionOutput(0, "xyzab", [1, 2, 3])
    delta = cursor.advance(running)
    assert delta is not None and delta.text == "xyz" and delta.token_ids == [1, 2, 3]
    assert cursor.advance(running) is None
    done = CompletionOutput(0, "xyzabd", [1, 2, 3, 4], finish_reason="length")
    delta = cursor.advance(done)
    assert delta is not None and delta.text == "abd" and delta.finish_reason == "length"
    assert cursor.advance(done) is None


def test_sse_chunk_shape() -> None:
    """A chunk is `data: <json>\\n\\n` with OpenAI's keys; unset optional fields are omitted."""
    chunk = r.CompletionChunk(
        id="cmpl-1",
        created=1,
        model="m",
        choices=[r.CompletionChoice(index=0, text="hi", logprobs=None, finish_reason=None)],
    )
    event = r.sse(chunk)
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[6:]) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}],
    }


# Texts a model may make whose JSON is not the text itself: escapes, control characters,
# characters past ASCII (left unescaped), the separators JavaScript treats as line ends, the
# marker `TextEvents` renders with.
_TEXTS = [
    "hello",
    " world",
    "",
    '"quoted"',
    "back\\slash",
    "new\nline\ttab\r",
    "\x00\x01\x1f\x7f",
    "é日本語🎉",
    "\u2028\u2029",
    "</script>",
    "\x00\x01baton-text\x01\x00",
]


Render = Callable[[str, list[int]], str]


def _completion_event(usage: dict[str, Any], with_ids: bool) -> Render:
    def render(text: str, token_ids: list[int]) -> str:
        ids = {"token_ids": token_ids} if with_ids else {}
        choice = r.CompletionChoice(
            index=2, text=text, logprobs=None, finish_reason=None, stop_reason=None, **ids
        )
        return r.sse(
            r.CompletionChunk(id="cmpl-1", created=1, model="m", choices=[choice], **usage)
        )

    return render


def _chat_event(with_ids: bool) -> Render:
    def render(text: str, token_ids: list[int]) -> str:
        choice = r.ChatStreamChoice(
            index=0,
            delta=r.DeltaMessage(content=text),
            logprobs=None,
            finish_reason=None,
            stop_reason=None,
            **({"token_ids": token_ids} if with_ids else {}),
        )
        return r.sse(r.ChatCompletionChunk(id="chatcmpl-1", created=1, model="m", choices=[choice]))

    return render


@pytest.mark.parametrize(
    ("render", "with_ids"),
    [
        (_completion_event({}, False), False),
        (_completion_event({"usage": None}, False), False),
        (_completion_event({}, True), True),
        (_chat_event(False), False),
        (_chat_event(True), True),
    ],
    ids=["completion", "completion-usage-null", "completion-token-ids", "chat", "chat-token-ids"],
)
def test_text_events_are_the_models_events(render: Render, with_ids: bool) -> None:
    """An event spliced from the template is, byte for byte, the event the chunk's models
    make for the same text (and token ids), whatever the text holds."""
    events = r.TextEvents.make(render, with_ids)
    assert events is not None
    for k, text in enumerate(_TEXTS):
        ids = [*range(k), 2**40]  # one to several, one past any vocabulary
        assert events(text, ids) == render(text, ids), repr(text)


def test_text_events_are_refused_where_a_marker_shows_twice() -> None:
    """A template that holds a marker's JSON anywhere but where the text or the ids go (a
    field whose value is the marker) is refused, and the stream renders through the models."""
    marker = "\x00\x01baton-text\x01\x00"

    def render(response_id: str, prompt_ids: list[int] | None = None) -> Render:
        def event(text: str, token_ids: list[int]) -> str:
            choice = r.CompletionChoice(index=0, text=text, token_ids=token_ids)
            if prompt_ids is not None:
                choice.prompt_token_ids = token_ids
            return r.sse(r.CompletionChunk(id=response_id, created=1, model="m", choices=[choice]))

        return event

    assert r.TextEvents.make(render("cmpl-1"), True) is not None
    assert r.TextEvents.make(render(marker), False) is None
    assert r.TextEvents.make(render(marker), True) is None
    assert r.TextEvents.make(render("cmpl-1", []), True) is None  # the ids' marker twice
    assert r.TextEvents.make(lambda text, ids: "no marker here", False) is None
