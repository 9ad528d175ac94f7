"""The tool-call and reasoning parsers as pure functions: each format's calls and content, and
the streamed deltas, over any chunking of the answer, adding up to the whole answer's parse."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baton.engine.api import tools
from baton.engine.api.reasoning import reasoning_parser
from baton.engine.api.tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    tool_parser,
)

WEATHER = {"city": "Paris", "unit": "celsius"}
HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
)
LLAMA = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    '; {"name": "get_time", "parameters": {"tz": "Europe/Paris"}}'
)
MISTRAL = (
    'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
    '"celsius"}}, {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]'
)


def _mode(
    parser: ToolParser | None,
    reasoning: str | None = None,
    state: Any = "auto",
    parallel: bool = True,
) -> Any:
    r = reasoning_parser(reasoning) if reasoning else None
    forced = isinstance(parser, (NamedToolParser, RequiredToolParser))
    return tools.OutputMode(parser, forced, r, state if r else "closed", parallel)


def _calls(message: tools.Message) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for _, c in message.calls]


@pytest.mark.parametrize(
    ("name", "text", "content"),
    [
        ("hermes", HERMES, "Let me check.\n"),
        ("llama3_json", LLAMA, None),
        ("mistral", MISTRAL, "Sure."),
    ],
)
def test_each_format_gives_its_calls_and_content(name: str, text: str, content: str | None) -> None:
    message = tools.ChoiceParser(_mode(tool_parser(name))).message(text)
    assert _calls(message) == [("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})]
    assert message.content == content
    assert all(i.startswith("chatcmpl-tool-") for i, _ in message.calls)


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_text_without_calls_is_all_content(name: str) -> None:
    text = "The weather in Paris is mild {not json} [TOOL_CALLS"
    message = tools.ChoiceParser(_mode(tool_parser(name))).message(text)
    assert message.calls == [] and message.content == text


@pytest.mark.parametrize(
    ("name", "text"), [("hermes", HERMES), ("llama3_json", LLAMA), ("mistral", MISTRAL)]
)
def test_parallel_tool_calls_false_keeps_the_first_call(name: str, text: str) -> None:
    """`parallel_tool_calls: false` answers with the first call only, as vLLM does (it drops
    the others), whole and streamed; the content is the same as with every call."""
    whole = tools.ChoiceParser(_mode(tool_parser(name))).message(text)
    first = tools.ChoiceParser(_mode(tool_parser(name), parallel=False)).message(text)
    assert _calls(first) == [("get_weather", WEATHER)] and first.content == whole.content
    streamed = _streamed(_mode(tool_parser(name), parallel=False), text, list(range(len(text))))
    assert streamed["calls"] == [{"name": "get_weather", "arguments": json.dumps(WEATHER)}]


def test_a_call_that_does_not_parse_stays_content() -> None:
    bad = '<tool_call>{"name": "f", "arguments": {</tool_call>'
    text = bad + ' and <tool_call>{"name": "g"}</tool_call>'
    message = tools.ChoiceParser(_mode(tool_parser("hermes"))).message(text)
    assert _calls(message) == [("g", {})]
    assert message.content == bad + " and "


def test_required_and_named() -> None:
    required = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]'
    message = tools.ChoiceParser(_mode(RequiredToolParser())).message(required)
    assert _calls(message) == [("get_weather", WEATHER)] and message.content is None
    named = json.dumps(WEATHER)
    message = tools.ChoiceParser(_mode(NamedToolParser("get_weather"))).message(named)
    assert [(c.name, c.arguments) for _, c in message.calls] == [("get_weather", named)]


def test_reasoning_parsers() -> None:
    text = "<think>It is 20 C.</think>\n\nMild."
    for name in ("deepseek_r1", "qwen3"):
        message = tools.ChoiceParser(_mode(None, name)).message(text)
        assert (message.reasoning, message.content) == ("It is 20 C.", "\n\nMild.")
    # R1's template opened the thinking: all before </think> is reasoning, all of an open one.
    r1 = tools.ChoiceParser(_mode(None, "deepseek_r1"))
    assert r1.message("hmm</think>ok").reasoning == "hmm"
    assert (r1.message("still thinking").reasoning, r1.message("still thinking").content) == (
        "still thinking",
        None,
    )
    # Qwen3 reasons only when it opens with <think>, or the prompt opened it.
    q = tools.ChoiceParser(_mode(None, "qwen3"))
    assert (q.message("plain").reasoning, q.message("plain").content) == (None, "plain")
    opened = tools.ChoiceParser(_mode(None, "qwen3", "open"))
    assert opened.message("hmm</think>ok").reasoning == "hmm"
    closed = tools.ChoiceParser(_mode(None, "qwen3", "closed"))
    assert closed.message("<think>x</think>y").content == "<think>x</think>y"
    parser = reasoning_parser("qwen3")
    assert parser.state_after("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "closed"
    assert parser.state_after("<|im_start|>assistant\n<think>\n") == "open"
    assert parser.state_after("<|im_start|>assistant\n") == "auto"


def test_reasoning_then_a_call() -> None:
    text = "<think>need weather</think>\n" + HERMES
    message = tools.ChoiceParser(_mode(tool_parser("hermes"), "qwen3")).message(text)
    assert message.reasoning == "need weather" and len(message.calls) == 2
    assert message.content == "\nLet me check.\n"


def test_unknown_names_list_the_known() -> None:
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("nope")
    with pytest.raises(ValueError, match="deepseek_r1"):
        reasoning_parser("nope")


def _streamed(mode: Any, text: str, cuts: list[int]) -> dict[str, Any]:
    """The deltas of a stream that received `text` in pieces cut at `cuts`, assembled."""
    parser = tools.ChoiceParser(mode)
    reasoning, content = "", ""
    calls: list[dict[str, Any]] = []
    bounds = [*sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    for end in bounds:
        delta = parser.advance(text[:end], final=end == len(text))
        reasoning += delta.reasoning
        content += delta.content
        for c in delta.calls:
            if c.id is not None:
                assert c.index == len(calls) and c.name is not None
                assert c.id.startswith("chatcmpl-tool-")
                calls.append({"name": c.name, "arguments": c.arguments})
            else:
                assert c.name is None and c.index < len(calls)
                calls[c.index]["arguments"] += c.arguments
    return {"reasoning": reasoning or None, "content": content or None, "calls": calls}


def _whole(mode: Any, text: str) -> dict[str, Any]:
    message = tools.ChoiceParser(mode).message(text)
    return {
        "reasoning": message.reasoning or None,
        "content": message.content or None,
        "calls": [{"name": c.name, "arguments": c.arguments} for _, c in message.calls],
    }


CASES = [
    (lambda: _mode(tool_parser("hermes")), HERMES),
    (lambda: _mode(tool_parser("hermes")), HERMES + "\nDone."),
    (lambda: _mode(tool_parser("hermes")), "<tool_call>{bad}</tool_call> plain <tool_ca"),
    (lambda: _mode(tool_parser("llama3_json")), LLAMA),
    (lambda: _mode(tool_parser("llama3_json")), '  {"name": "f", "parameters": {}} trailing'),
    (lambda: _mode(tool_parser("llama3_json")), "<|python_ta no call here"),
    (lambda: _mode(tool_parser("mistral")), MISTRAL),
    (lambda: _mode(tool_parser("mistral")), "Sure.[TOOL_CALLS] [{broken"),
    (
        lambda: _mode(RequiredToolParser()),
        '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]',
    ),
    (lambda: _mode(RequiredToolParser()), '[{"name": "a", "parameters": {"x": '),
    (lambda: _mode(tool_parser("hermes"), parallel=False), HERMES + "\nDone."),
    (lambda: _mode(tool_parser("mistral"), parallel=False), MISTRAL),
    (lambda: _mode(NamedToolParser("f")), '{"city": "Paris"}'),
    (lambda: _mode(tool_parser("hermes"), "qwen3"), "<think>plan a call</think>\n\n" + HERMES),
    (lambda: _mode(tool_parser("hermes"), "qwen3"), "no thinking, " + HERMES),
    (lambda: _mode(None, "deepseek_r1"), "<think>a</think>b</think>c"),
    (lambda: _mode(None, "deepseek_r1"), "unclosed </thi"),
    (lambda: _mode(NamedToolParser("f"), "qwen3", "open"), 'why</think>{"city": "Paris"}'),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=40))
def test_streamed_deltas_add_up_to_the_whole_answer(case: int, cuts: list[int]) -> None:
    make, text = CASES[case]
    assert _streamed(make(), text, cuts) == _whole(make(), text)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_streamed_token_by_token(case: int) -> None:
    make, text = CASES[case]
    assert _streamed(make(), text, list(range(len(text)))) == _whole(make(), text)
