"""Tool calling and reasoning against the real engine server, with the `openai` client: one
server for the module, started as a Qwen deployment would be (`--enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser qwen3` and a Hermes-style chat template).

On the random tiny model only a grammar can make an answer a valid call, so the forced tool
choice tests need the engine's structured outputs (the grammar branches); they are skipped
where this tree has none. Streamed and whole answers are compared under greedy sampling."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.support.engine_server import ROOT, Server, start_server

TEMPLATE = Path(__file__).parent / "templates" / "hermes_tools.jinja"
SCHEMAS: dict[str, dict[str, Any]] = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Oslo", "Lima"]},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "add": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "is_open": {
        "type": "object",
        "properties": {"now": {"type": "boolean"}},
        "required": ["now"],
        "additionalProperties": False,
    },
}
TOOLS: Any = [
    {"type": "function", "function": {"name": n, "description": n, "parameters": s}}
    for n, s in SCHEMAS.items()
]
MESSAGES: Any = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
# On the tiny model the thinking never closes by chance: with it closed in the prompt, the
# grammar constrains from the first token.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}

# The grammar backend (wt-grammar) and the scheduler that masks with it (wt-sched).
needs_grammar = pytest.mark.skipif(
    importlib.util.find_spec("baton.engine.structured") is None
    or importlib.util.find_spec("baton.engine.scheduler.structured") is None,
    reason="needs the engine's structured outputs (the grammar and scheduler branches)",
)


@pytest.fixture(scope="module")
def tools_server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        model,
        tmp_path_factory.mktemp("tools-server"),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--chat-template",
        str(TEMPLATE),
        # The tools in the prompt take ~870 tokens of the tiny model's vocabulary: room for
        # answers (the last flag wins over the helper's 1024; the model has 2048 positions).
        "--max-model-len",
        "2048",
    )
    try:
        yield s
    finally:
        s.stop()


def _check_calls(message: Any) -> None:
    assert message.tool_calls and message.content is None
    for call in message.tool_calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@needs_grammar
def test_required_always_yields_valid_calls(tools_server: Server) -> None:
    resp = tools_server.client().chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        n=4,
        temperature=1.0,
        seed=7,
        max_tokens=800,
        extra_body=NO_THINKING,
    )
    for choice in resp.choices:
        # The random model may go on adding calls (or whitespace, which the grammar allows)
        # until the limit: every call it finished still parses and validates.
        assert choice.finish_reason in ("tool_calls", "length"), choice
        _check_calls(choice.message)


@needs_grammar
def test_named_and_single_calls(tools_server: Server) -> None:
    client = tools_server.client()
    named = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        temperature=1.0,
        seed=3,
        max_tokens=200,
        extra_body=NO_THINKING,
    )
    message: Any = named.choices[0].message
    _check_calls(message)
    assert [c.function.name for c in message.tool_calls] == ["add"]
    single = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=5,
        max_tokens=800,
        extra_body=NO_THINKING,
    )
    _check_calls(single.choices[0].message)
    assert len(single.choices[0].message.tool_calls or []) == 1


def _assembled(chunks: Any) -> dict[str, Any]:
    content, reasoning, finish = "", "", None
    calls: list[dict[str, str]] = []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for c in delta.tool_calls or []:
                if c.id is not None:
                    calls.append({"name": c.function.name, "arguments": ""})
                calls[c.index]["arguments"] += c.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": content, "reasoning": reasoning, "calls": calls, "finish": finish}


def _whole(choice: Any) -> dict[str, Any]:
    m = choice.message
    calls = [
        {"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or []
    ]
    reasoning = getattr(m, "reasoning_content", None) or ""
    return {
        "content": m.content or "",
        "reasoning": reasoning,
        "calls": calls,
        "finish": choice.finish_reason,
    }


def _both(server: Server, **body: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    client: Any = server.client()
    args = {"model": "tiny", "messages": MESSAGES, "temperature": 0.0, "max_tokens": 40, **body}
    whole = client.chat.completions.create(**args)
    streamed = client.chat.completions.create(stream=True, **args)
    return _whole(whole.choices[0]), _assembled(streamed)


def test_auto_streamed_equals_whole(tools_server: Server) -> None:
    """The parsers on the model's own (noise) answer: whatever they find, both ways alike."""
    whole, streamed = _both(tools_server, tools=TOOLS)
    assert streamed == whole
    whole, streamed = _both(tools_server, tools=TOOLS, extra_body=NO_THINKING)
    assert streamed == whole and whole["reasoning"] == ""


def test_include_reasoning_false_leaves_the_reasoning_out(tools_server: Server) -> None:
    """vLLM's `include_reasoning: false`: the same answer without its reasoning, whole and
    streamed (no chunk that would carry only reasoning goes out)."""
    # An answer that goes on inside an open <think> (continue_final_message): reasoning until
    # the noise closes it.
    thinking = [*MESSAGES, {"role": "assistant", "content": "<think>\n"}]
    extra = {"continue_final_message": True}
    whole, _ = _both(tools_server, messages=thinking, extra_body=extra)
    assert whole["reasoning"]
    hidden, streamed = _both(
        tools_server, messages=thinking, extra_body={**extra, "include_reasoning": False}
    )
    assert hidden == {**whole, "reasoning": ""} and streamed == hidden
    client: Any = tools_server.client()
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=thinking,
            max_tokens=40,
            stream=True,
            extra_body={**extra, "include_reasoning": False},
        )
    )
    assert all(
        getattr(c.delta, "reasoning_content", None) is None for ch in chunks for c in ch.choices
    )


@needs_grammar
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_streamed_equals_whole(tools_server: Server, choice: Any) -> None:
    # Seeded sampling, not greedy: the random model's argmax writes whitespace forever.
    whole, streamed = _both(
        tools_server,
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        temperature=1.0,
        seed=11,
        max_tokens=800,
        extra_body=NO_THINKING,
    )
    assert streamed == whole and len(whole["calls"]) == 1
    if whole["finish"] != "length":
        assert whole["finish"] == ("tool_calls" if choice == "required" else "stop")  # vLLM's


def test_auto_without_the_flag_is_refused_and_unknown_parsers_stop_the_start(
    server: Server,
) -> None:
    """The package's shared server runs without tool flags: auto is vLLM's 400 there."""
    import openai

    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        server.client().chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=TOOLS,
        )
    out = subprocess.run(
        [sys.executable, "-m", "baton.engine.api.cli", "--tool-call-parser", "nope"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 2 and "hermes" in out.stderr and "llama3_json" in out.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("baton.engine.api.constraints") is None,
    reason="needs the api branch's grammar check at the edge",
)
def test_a_tool_schema_the_grammar_cannot_take_is_a_400(tools_server: Server) -> None:
    import openai

    bad: Any = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
            },
        }
    ]
    client = tools_server.client()
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=bad, tool_choice="required", max_tokens=4
        )
    ok = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    assert ok.choices[0].message.role == "assistant"  # the engine goes on serving
