"""A resumed chat stream with reasoning and tool calls, over a fake engine that writes a set
answer: wherever the first stream was cut, its chunks up to the cut and the resumed stream's
add up to the single stream's message (no reasoning, content or call sent twice or lost)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from baton.engine.output_processor import OutputProcessor
from baton.engine.outputs import RequestOutput
from baton.engine.protocol import EngineCoreOutput
from baton.engine.sampling_params import SamplingParams
from tests.engine.api.test_chat_tools import (
    HERMES_ANSWER,
    TOOLS,
    AnswerLLM,
    _app,
    _assembled,
    _chat,
)
from tests.engine.api.test_protocol import _events


class ResumingLLM(AnswerLLM):
    """`AnswerLLM` that resumes: the answer goes on after `resume_token_ids`, whose
    characters it must begin with."""

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
        kv_transfer_params: dict | None = None,
        resume_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        sink: object = None,  # never offered a snapshot: every one is yielded
    ) -> AsyncIterator[RequestOutput]:
        resumed = resume_token_ids or []
        tokens = [ord(c) for c in self.answer] + [0]
        assert tokens[: len(resumed)] == resumed
        processor = OutputProcessor(self.tokenizer)
        processor.add_request(
            request_id, prompt, prompt_token_ids, [request_id], sampling_params, resumed
        )
        for step in range(len(resumed), len(tokens)):
            reason = "stop" if step + 1 == len(tokens) else None
            updates, _ = processor.process_outputs(
                [EngineCoreOutput(request_id, [tokens[step]], finish_reason=reason)]
            )
            await asyncio.sleep(0)
            for update in updates:
                yield update


def _received(events: list[Any], num_tokens: int) -> list[Any]:
    """The chunks a client had once it had `num_tokens` tokens (one token per chunk here)."""
    out, tokens = [], 0
    for event in events:
        tokens += sum(len(c.get("token_ids") or []) for c in event["choices"])
        if tokens > num_tokens:
            break
        out.append(event)
    return out


def test_a_resumed_stream_goes_on_with_the_reasoning_content_and_calls_parsed_so_far() -> None:
    """Cut inside the reasoning, at its end, in the content, inside the call's name and its
    arguments: the parsers start as if they had streamed the resumed text, so the two
    streams together are the single stream's message, the call opened once."""
    app = _app(ResumingLLM(HERMES_ANSWER))
    body = {"tools": TOOLS, "stream": True, "return_token_ids": True}
    single = _events(_chat(app, **body))
    expected = _assembled(single)
    assert expected["reasoning_content"] and expected["content"] and expected["tool_calls"]
    ids = [t for e in single for c in e["choices"] for t in c.get("token_ids") or []]
    assert len(ids) == len(HERMES_ANSWER) + 1
    for k in [*range(1, len(ids), 7), HERMES_ANSWER.index("</think>") + 8]:
        resumed = _events(_chat(app, **body, resume_token_ids=ids[:k]))
        assert all("role" not in c["delta"] for e in resumed for c in e["choices"])
        assert _assembled(_received(single, k) + resumed) == expected, k
