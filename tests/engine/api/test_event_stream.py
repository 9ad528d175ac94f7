"""The engine's event stream at the ASGI level: each event one body message, and the cleanup
(which aborts the engine requests) run once however the stream ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from baton.engine.api.streams import EventStream


class _Ends:
    def __init__(self) -> None:
        self.cleaning = False
        self.cleanups = 0
        self.events_closed = False

    async def cleanup(self) -> None:
        self.cleaning = True
        for _ in range(3):  # awaits that a stray cancellation would cut short
            await asyncio.sleep(0)
        self.cleanups += 1


def _events(ends: _Ends, items: list[str], then_wait: bool = False) -> AsyncGenerator[str, None]:
    async def gen() -> AsyncGenerator[str, None]:
        try:
            for item in items:
                yield item
            if then_wait:  # an engine that has nothing more yet
                await asyncio.Event().wait()
        finally:
            ends.events_closed = True

    return gen()


async def _run(stream: EventStream, disconnect_after: float | None) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if disconnect_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(disconnect_after or 0)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await asyncio.wait_for(stream({"type": "http"}, receive, send), 5)
    return sent


def test_each_event_is_one_body_message_then_the_end() -> None:
    """Headers, one message per event (more to come), an empty last one; cleanup once."""
    ends = _Ends()
    sent = asyncio.run(_run(EventStream(_events(ends, ["a", "b"]), ends.cleanup), None))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    bodies = [(m["body"], m["more_body"]) for m in sent[1:]]
    assert bodies == [(b"a", True), (b"b", True), (b"", False)]
    assert ends.cleanups == 1 and ends.events_closed


def test_a_client_gone_while_the_engine_is_silent_ends_the_stream() -> None:
    """A disconnect while no event comes (a queued request) ends the response without an error
    and runs the cleanup, which aborts the engine request, at once and once."""
    ends = _Ends()
    stream = EventStream(_events(ends, ["a"], then_wait=True), ends.cleanup)
    sent = asyncio.run(_run(stream, 0.05))
    assert [m.get("body") for m in sent[1:]] == [b"a"]  # no end: the client is gone
    assert ends.cleanups == 1 and ends.events_closed


def test_a_client_gone_before_any_event_still_cleans_up() -> None:
    """The engine never answered and the client left: the cleanup still runs once."""
    ends = _Ends()
    sent = asyncio.run(_run(EventStream(_events(ends, [], then_wait=True), ends.cleanup), 0))
    assert [m["type"] for m in sent] == ["http.response.start"]
    assert ends.cleanups == 1 and ends.events_closed


def test_a_cancellation_from_outside_is_not_swallowed() -> None:
    """Only the stream's own watcher's cancellation ends it quietly; the server's (a shutdown)
    propagates, after the cleanup ran."""
    ends = _Ends()
    stream = EventStream(_events(ends, ["a"], then_wait=True), ends.cleanup)

    async def go() -> None:
        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()
            return {}

        async def send(message: dict[str, Any]) -> None:
            pass

        task = asyncio.ensure_future(stream({"type": "http"}, receive, send))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert ends.cleanups == 1 and ends.events_closed


def test_a_disconnect_during_the_cleanup_does_not_cut_it_short() -> None:
    """The client's disconnect, seen while the cleanup awaits (after the last message), must
    not cancel the cleanup."""
    ends = _Ends()

    async def go() -> None:
        async def receive() -> dict[str, Any]:
            while not ends.cleaning:
                await asyncio.sleep(0)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            pass

        await EventStream(_events(ends, ["a"]), ends.cleanup)({"type": "http"}, receive, send)

    asyncio.run(go())
    assert ends.cleanups == 1 and ends.events_closed
