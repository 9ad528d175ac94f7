"""Mid-stream migration in the router, against fake engines that resume a stream as Baton's
engines do (`resume_token_ids`): the client's stream goes on from another engine, whole and
once, up to `--migration-limit`; the parsing of the engines' events on its own."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from baton.router.migration import StreamLog
from tests.router.harness import FakeCluster, routed

BODY = {"model": "fake", "prompt": "a prompt", "max_tokens": 8, "stream": True}


def _events(url: str, route: str = "/v1/completions", **extra: Any) -> list[dict[str, Any]]:
    """The stream's data events, parsed ([DONE] as the string)."""
    body = {**BODY, **extra}
    if route.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    with httpx.stream("POST", f"{url}{route}", json=body, timeout=10) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def _text(events: list[Any], chat: bool = False) -> str:
    parts = []
    for event in events:
        for choice in event["choices"] if isinstance(event, dict) else ():
            parts.append(choice["delta"].get("content", "") if chat else choice["text"])
    return "".join(parts)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_broken_stream_goes_on_from_another_engine(cluster: FakeCluster, route: str) -> None:
    """Engines break after 5 chunks of 8: the client gets every token once, in order, the
    last 3 from the second engine, with the migration in the final chunk, no token ids it did
    not ask for, and one `resumed` migration counted."""
    first, _ = cluster.add()
    second, _ = cluster.add()
    for engine in (first, second):
        engine.break_after_chunks = 5
    with routed(cluster, decode_policy="round-robin", migration_limit=3) as router:
        events = _events(router.url, route)
        assert events[-1] == "[DONE]"
        chunks = [e for e in events if isinstance(e, dict)]
        assert len(chunks) == 8
        assert all("token_ids" not in c["choices"][0] for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["baton_migrations"] == 1
        assert router.metric("baton:router_migrations_total", outcome="resumed") == 1
        resumed = [r for e in (first, second) for r in e.requests if "resume_token_ids" in r]
        assert [r["resume_token_ids"] for r in resumed] == [[0, 1, 2, 3, 4]]
        assert all(r["return_token_ids"] is True for e in (first, second) for r in e.requests)


def test_the_migrated_answer_equals_an_unbroken_one(cluster: FakeCluster) -> None:
    """Text and token ids (asked for by the client) equal an unbroken stream's."""
    engine, _ = cluster.add()
    cluster.add()
    with routed(cluster, decode_policy="round-robin") as router:
        whole = _events(router.url, return_token_ids=True)
        engine.break_after_chunks = 2
        moved = _events(router.url, return_token_ids=True)
        moved += _events(router.url, return_token_ids=True)  # one or both start on `engine`
        assert router.metric("baton:router_migrations_total", outcome="resumed") >= 1
    assert _ids(whole) == list(range(8)) and len(_text(whole).split()) == 8
    half = len(moved) // 2
    for stream in (moved[:half], moved[half:]):
        assert _text(stream) == _text(whole) and _ids(stream) == _ids(whole)


def _ids(events: list[Any]) -> list[int]:
    return [i for e in events if isinstance(e, dict) for i in e["choices"][0]["token_ids"]]


def test_the_migration_limit_ends_the_stream_with_an_error(cluster: FakeCluster) -> None:
    """Engines that all break: after `migration_limit` migrations the stream ends with a 502
    error event and [DONE], and the limit is counted."""
    for _ in range(3):
        engine, _ = cluster.add()
        engine.break_after_chunks = 1
    with routed(cluster, migration_limit=2, eject_after_failures=100) as router:
        events = _events(router.url)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == 502
        assert "after 2 migrations" in events[-2]["error"]["message"]
        assert len([e for e in events if "choices" in e]) == 3  # one chunk from each engine
        assert router.metric("baton:router_migrations_total", outcome="resumed") == 2
        assert router.metric("baton:router_migrations_total", outcome="limit_reached") == 1


def test_no_migration_with_limit_zero_or_no_other_engine(cluster: FakeCluster) -> None:
    """Limit 0: the stream ends with the 502 error event at once, engines are not asked for
    token ids. One engine only: the migration fails, counted as such."""
    engine, _ = cluster.add()
    engine.break_after_chunks = 1
    with routed(cluster, migration_limit=0) as router:
        events = _events(router.url)
        assert events[-2]["error"]["code"] == 502 and events[-1] == "[DONE]"
        assert "return_token_ids" not in engine.requests[-1]
    with routed(cluster) as router:
        events = _events(router.url)
        assert events[-2]["error"]["code"] == 502 and events[-1] == "[DONE]"
        assert router.metric("baton:router_migrations_total", outcome="failed") == 1


def test_an_engine_going_away_in_band_migrates_but_a_client_error_does_not(
    cluster: FakeCluster,
) -> None:
    """A 503 error event (a draining engine) moves the stream; a 4xx error event is the
    client's own and reaches it as it is."""
    first, _ = cluster.add()
    second, _ = cluster.add()
    for engine in (first, second):
        engine.break_after_chunks, engine.error_event_code = 5, 503
    with routed(cluster, decode_policy="round-robin") as router:
        whole = _events(router.url, max_tokens=5)
        events = _events(router.url)
        assert events[-1] == "[DONE]" and _text(events).startswith(_text(whole))
        assert len(_text(events).split()) == 8
        assert router.metric("baton:router_migrations_total", outcome="resumed") == 1
        for engine in (first, second):
            engine.error_event_code = 400
        events = _events(router.url)
        assert events[-2]["error"]["code"] == 400 and events[-1] == "[DONE]"


def test_client_fields_only_the_router_sets_are_dropped(cluster: FakeCluster) -> None:
    """A client's `resume_token_ids` never reaches an engine."""
    engine, _ = cluster.add()
    with routed(cluster) as router:
        _events(router.url, resume_token_ids=[1, 2, 3])
    assert "resume_token_ids" not in engine.requests[-1]


def test_the_stream_log_reads_compact_events_split_anywhere() -> None:
    """Events as a Baton engine writes them, cut into pieces at every byte: the ids are kept,
    the token ids taken out, the finish chunk annotated, an error event held back."""
    events = (
        b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"a\\"b",'
        b'"token_ids":[5,6],"prompt_token_ids":[1,2]}]}\n\n'
        b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"",'
        b'"token_ids":[7]}]}\n\n'
        b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"x",'
        b'"finish_reason":"length","token_ids":[8]}]}\n\n'
        b"data: [DONE]\n\n"
    )
    for step in (1, 7, len(events)):
        log = StreamLog(strip_token_ids=True)
        log.annotation = b',"baton_migrations":1'
        out = b"".join(log.feed(events[i : i + step]) for i in range(0, len(events), step))
        chunks = [json.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
        assert log.token_ids() == [5, 6, 7, 8] and log.done and log.finished
        assert [c["choices"][0]["text"] for c in chunks] == ['a"b', "", "x"]
        assert all(set(c["choices"][0]) <= {"index", "text", "finish_reason"} for c in chunks)
        assert chunks[-1]["baton_migrations"] == 1
    spaced = (
        b'data: {"id": "c", "choices": [{"index": 0, "text": "y", "token_ids": [9, 10], '
        b'"finish_reason": "stop"}], "prompt_token_ids": [1]}\n\n'
    )
    log = StreamLog(strip_token_ids=True)
    log.annotation = b',"baton_migrations":2'
    chunk = json.loads(log.feed(spaced)[6:])
    assert chunk == {"id": "c", "choices": [{"index": 0, "text": "y", "finish_reason": "stop"}],
                     "baton_migrations": 2}  # fmt: skip
    assert log.token_ids() == [9, 10] and log.finished
    error = b'data: {"object": "error", "error": {"message": "going away", "code": 503}}\n\n'
    log = StreamLog(strip_token_ids=False)
    assert log.feed(error + b"data: [DONE]\n\n") == b""
    assert log.error == "going away" and not log.done
    later = b'data: {"id":"c","choices":[{"index":0,"text":"z","token_ids":[11]}]}\n\n'
    assert log.feed(later + b"data: [DONE]\n\n") == b""  # read after the error: dropped
    assert log.token_ids() == [] and not log.done
    log.restart()
    assert log.feed(later) == later and log.token_ids() == [11] and log.error is None
