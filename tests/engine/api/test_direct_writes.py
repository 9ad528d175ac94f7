"""The engine's output loop writing a streamed answer's events itself (`PromptStream.direct`),
against a fake engine that offers its snapshots as `AsyncLLM` does and a server write that
refuses at chosen points (a client that stopped reading): the bytes that reach the client, in
order, are the events the stream's task alone sends, with tool calls and reasoning parsed."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from baton.engine.async_llm import _Stream
from baton.engine.outputs import RequestOutput
from baton.engine.sampling_params import SamplingParams
from baton.http_server import BODY_WRITER
from tests.engine.api.test_chat_tools import HERMES_ANSWER, TOOLS, USER, AnswerLLM, _app


class OfferingLLM(AnswerLLM):
    """`AnswerLLM`'s snapshots, put on a real `_Stream` as the output loop puts them, so that
    its sink is offered those that come while the reader waits."""

    def __init__(self, answer: str) -> None:
        super().__init__(answer)
        self.taken = 0  # snapshots the sink took

    async def generate(  # type: ignore[override]
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        sink: Callable[[RequestOutput], bool] | None = None,
        **unused: Any,  # what else `AsyncLLM.generate` takes: this engine writes one answer
    ) -> AsyncIterator[RequestOutput]:
        def counted(out: RequestOutput) -> bool:
            taken = sink is not None and sink(out)
            self.taken += taken
            return taken

        stream = _Stream(counted)
        steps = super().generate(request_id, prompt_token_ids, sampling_params, prompt)

        async def produce() -> None:
            async for out in steps:
                stream.put(out)
                await asyncio.sleep(0)  # the reader runs now and then, as between messages

        producer = asyncio.ensure_future(produce())
        try:
            while not (out := await stream.get()).finished:
                yield out
            yield out
        finally:
            producer.cancel()


def _stream(app: Any, refuse: Callable[[int], bool] | None, **body: Any) -> bytes:
    """The streamed answer's bytes in the order they reach the client: those the server's
    write took (`refuse(i)` says whether its i-th call, the probes included, refuses) and those
    sent through ASGI `send`. With `refuse` None the server has no write at all."""
    sent: list[bytes] = []

    async def served(scope: Any, receive: Any, send: Any) -> None:
        if refuse is not None:
            calls = iter(range(10**9))

            def write(chunk: bytes) -> bool:
                if refuse(next(calls)):
                    return False
                sent.append(chunk)
                return True

            scope = {**scope, "extensions": {**(scope.get("extensions") or {}), BODY_WRITER: write}}

        async def send_body(message: Any) -> None:
            if message["type"] == "http.response.body":
                sent.append(message.get("body", b""))
            await send(message)

        await app(scope, receive, send_body)

    async def go() -> None:
        transport = httpx.ASGITransport(app=served)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.post(
                "/v1/chat/completions", json={"messages": USER, "stream": True, **body}
            )
            assert response.status_code == 200, response.text

    asyncio.run(go())
    return b"".join(sent)


def _events(raw: bytes) -> list[Any]:
    events = raw.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    # Each response has an id and a time of its own.
    return [
        json.loads(re.sub(r'"(id|created)":("[^"]*"|\d+)', r'"\1":0', e.removeprefix("data: ")))
        for e in events[:-2]
    ]


def _answer(events: list[Any]) -> dict[str, Any]:
    """What the events say in all: each field's text joined, each tool call's name and joined
    arguments, the last finish reason and the usage (a reader woken after refused writes gets
    the tokens since its last event in one)."""
    text: dict[str, str] = {}
    calls: dict[int, dict[str, str]] = {}
    finish, usage = None, None
    for event in events:
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            finish = choice["finish_reason"] or finish
            for key, value in choice["delta"].items():
                if key == "tool_calls":
                    for call in value:
                        mine = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                        function = call.get("function") or {}
                        mine["name"] += function.get("name") or ""
                        mine["arguments"] += function.get("arguments") or ""
                elif isinstance(value, str):
                    text[key] = text.get(key, "") + value
    return {"text": text, "calls": calls, "finish": finish, "usage": usage}


@pytest.mark.parametrize(
    "refuse",
    [lambda i: False, lambda i: i % 3 == 2, lambda i: 10 <= i < 40, lambda i: True],
    ids=["never", "every-third-call", "a-stretch", "always"],
)
@pytest.mark.parametrize("body", [{}, {"tools": TOOLS}], ids=["text", "tools-and-reasoning"])
def test_events_written_directly_are_the_streams_own(
    refuse: Callable[[int], bool], body: dict[str, Any]
) -> None:
    args = {"max_tokens": 200, "stream_options": {"include_usage": True}, **body}
    expected = _events(_stream(_app(AnswerLLM(HERMES_ANSWER)), None, **args))
    llm = OfferingLLM(HERMES_ANSWER)
    got = _events(_stream(_app(llm), refuse, **args))
    assert _answer(got) == _answer(expected)
    assert _answer(expected)["text"]["reasoning_content"] == "The user wants weather."
    if not refuse(0) or refuse(1):  # no write refused, or every one: the same events
        assert got == expected
    if not (refuse(0) and refuse(1)):  # (all refused: only snapshots that show nothing are)
        assert llm.taken > 10  # most of the answer's snapshots went the direct way
