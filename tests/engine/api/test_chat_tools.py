"""Tool calling and reasoning on /v1/chat/completions over a fake engine that writes a set
answer: the request's checks (400s naming the field), what reaches the engine (the grammar of a
forced tool choice, after `</think>` unless the prompt closed the thinking), the prompt the
templates render from tools and tool history, and the answers, whole and streamed alike."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from baton.engine.api.server import ServerConfig, build_app
from baton.engine.output_processor import OutputProcessor
from baton.engine.outputs import RequestOutput
from baton.engine.processor import child_requests
from baton.engine.protocol import EngineCoreOutput
from baton.engine.sampling_params import SamplingParams
from baton.engine.structured.backend import strict_json_schema
from baton.tokenizer import Tokenizer
from tests.engine.api.test_protocol import FakeLLM, _call, _error, _events, char_tokenizer

TEMPLATES = Path(__file__).parent / "templates"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_SCHEMA},
    },
    {"type": "function", "function": {"name": "get_time"}},
]
USER = [{"role": "user", "content": "weather in Paris?"}]
HERMES_ANSWER = (
    "<think>The user wants weather.</think>\n\nChecking.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


class AnswerLLM(FakeLLM):
    """Writes `answer`, one character per step, then an end token (or stops at max_tokens)."""

    def __init__(self, answer: str, template: str = "hermes_tools.jinja") -> None:
        super().__init__()
        self.answer = answer
        self.max_model_len = 4096
        text = (TEMPLATES / template).read_text()
        self.tokenizer = Tokenizer(char_tokenizer().backend, chat_template=text)

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
        self.seen.append((request_id, prompt_token_ids, sampling_params))
        processor = OutputProcessor(self.tokenizer)
        children = child_requests(request_id, sampling_params)
        processor.add_request(
            request_id, prompt, prompt_token_ids, [c for c, _ in children], sampling_params
        )
        # The answer's characters, then an end token (id 0) whose text, as an EOS's, is not
        # shown; cut at max_tokens with "length" instead.
        tokens = [ord(c) for c in self.answer] + [0]
        limit = min(len(tokens), sampling_params.max_tokens or len(tokens))
        for step in range(limit):
            last = step + 1 == limit
            reason = ("stop" if limit == len(tokens) else "length") if last else None
            outs = [
                EngineCoreOutput(child, [tokens[step]], finish_reason=reason)
                for child, _ in children
            ]
            updates, _ = processor.process_outputs(outs)
            await asyncio.sleep(0)
            for update in updates:
                yield update


class AcceptAll:
    """A grammar checker that takes every constraint (llguidance cannot read the char
    tokenizer; the grammars themselves are checked in test_tool_grammar)."""

    def validate(self, params: Any) -> None:
        pass


def _app(llm: FakeLLM, **config: Any) -> Any:
    defaults: dict[str, Any] = {
        "enable_auto_tool_choice": True,
        "tool_call_parser": "hermes",
        "reasoning_parser": "qwen3",
    }
    app = build_app(llm, ServerConfig(**{**defaults, **config}))  # type: ignore[arg-type]
    if hasattr(app.state.server, "_validator"):  # the api branch's grammar check, once merged
        app.state.server._validator = AcceptAll()
    return app


def _chat(app: Any, **body: Any) -> Any:
    return _call(app, "POST", "/v1/chat/completions", json={"messages": USER, **body})


# ---- the request's checks ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tools": [{"type": "function", "function": {}}]}, "tools", "name"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "function"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
        ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope'",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "distinct"),
        ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs", ""),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
                ]
            },
            "tools",
            "object",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(
    body: dict[str, Any], param: str, says: str
) -> None:
    llm = AnswerLLM("x")
    assert says in _error(_chat(_app(llm), **body), 400, param)
    assert llm.seen == []


def test_auto_needs_the_servers_parser() -> None:
    """vLLM's message; tool_choice defaults to auto once tools are given."""
    app = _app(AnswerLLM("x"), enable_auto_tool_choice=False, tool_call_parser=None)
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        message = _error(_chat(app, **body), 400, "tool_choice")
        assert "--enable-auto-tool-choice and --tool-call-parser" in message
    assert _chat(app, tools=TOOLS, tool_choice="none").status_code == 200


def test_history_arguments_must_be_json() -> None:
    history = [
        *USER,
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": "{oops"}}],
        },
    ]
    app = _app(AnswerLLM("x"))
    response = _call(app, "POST", "/v1/chat/completions", json={"messages": history})
    assert "arguments" in _error(response, 400, "messages")


def test_unknown_parser_names_stop_the_start() -> None:
    with pytest.raises(ValueError, match="hermes"):
        ServerConfig(tool_call_parser="nope")
    with pytest.raises(ValueError, match="qwen3"):
        ServerConfig(reasoning_parser="nope")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)


# ---- what reaches the engine ---------------------------------------------------------------


def _constraint(llm: AnswerLLM) -> Any:
    return llm.seen[-1][2].structured_outputs


def test_required_is_a_list_of_calls_grammar() -> None:
    llm = AnswerLLM('[{"name": "get_time", "parameters": {}}]')
    app = _app(llm, reasoning_parser=None)
    assert _chat(app, tools=TOOLS, tool_choice="required").status_code == 200
    c = _constraint(llm)
    schema = json.loads(c.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    items = schema["items"]["anyOf"]
    assert [i["properties"]["name"]["enum"] for i in items] == [["get_weather"], ["get_time"]]
    # the tool's objects closed: a forced call writes only the keys the function declares
    assert items[0]["properties"]["parameters"] == strict_json_schema(WEATHER_SCHEMA)
    assert c.after_token_ids is None
    _chat(app, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert json.loads(_constraint(llm).json)["maxItems"] == 1


def test_named_is_its_parameters_and_wins_over_response_format() -> None:
    llm = AnswerLLM('{"city": "Paris"}')
    app = _app(llm, reasoning_parser=None)
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert _chat(app, tools=TOOLS, tool_choice=named).status_code == 200
    assert json.loads(_constraint(llm).json) == strict_json_schema(WEATHER_SCHEMA)
    _chat(app, tools=TOOLS, tool_choice="none")
    assert _constraint(llm) is None
    _chat(app, tools=TOOLS)  # auto: the parser reads the answer, nothing constrains it
    assert _constraint(llm) is None


def test_the_grammar_starts_after_the_reasoning_unless_the_prompt_closed_it() -> None:
    llm = AnswerLLM('{"city": "Paris"}')
    app = _app(llm)
    end = tuple(llm.tokenizer.encode("</think>", add_special_tokens=False))
    _chat(app, tools=TOOLS, tool_choice="required")
    assert _constraint(llm).after_token_ids == end
    _chat(app, tools=TOOLS, tool_choice="required", chat_template_kwargs={"enable_thinking": False})
    assert _constraint(llm).after_token_ids is None
    prompt = llm.tokenizer.decode(llm.seen[-1][1])
    assert prompt.endswith("<think>\n\n</think>\n\n")


def test_mistral_keeps_its_marker_token() -> None:
    llm = AnswerLLM("x", "mistral_tools.jinja")
    _chat(_app(llm, tool_call_parser="mistral", reasoning_parser=None), tools=TOOLS)
    assert llm.seen[-1][2].skip_special_tokens is False


@pytest.mark.parametrize(
    "template", ["hermes_tools.jinja", "llama3_json.jinja", "mistral_tools.jinja"]
)
def test_tools_and_tool_history_reach_the_template(template: str) -> None:
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "chatcmpl-tool-1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "20 C"},
    ]
    llm = AnswerLLM("x", template)
    body = {"messages": history, "tools": TOOLS, "tool_choice": "none"}
    assert _call(_app(llm), "POST", "/v1/chat/completions", json=body).status_code == 200
    prompt = llm.tokenizer.decode(llm.seen[-1][1])
    assert '"get_weather"' in prompt and '"description": "Weather"' in prompt  # the tools
    assert '{"city": "Paris"}' in prompt  # the call's arguments, a dict rendered as JSON
    assert "20 C" in prompt


# ---- the answers ---------------------------------------------------------------------------


def _assembled(events: list[Any]) -> dict[str, Any]:
    """A stream's deltas put together as the message they add up to."""
    reasoning = content = ""
    calls: list[dict[str, Any]] = []
    finish = None
    for e in events:
        for choice in e["choices"]:
            delta = choice["delta"]
            assert delta.get("reasoning") == delta.get("reasoning_content")
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for c in delta.get("tool_calls", []):
                if "id" in c:
                    assert c["type"] == "function" and c["index"] == len(calls)
                    calls.append({"name": c["function"]["name"], "arguments": ""})
                else:
                    assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                calls[c["index"]]["arguments"] += c["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return {
        "reasoning_content": reasoning or None,
        "content": content or None,
        "tool_calls": [{"name": c["name"], "arguments": c["arguments"]} for c in calls],
        "finish_reason": finish,
    }


def _whole(choice: dict[str, Any]) -> dict[str, Any]:
    m = choice["message"]
    assert m.get("reasoning") == m.get("reasoning_content")
    for c in m.get("tool_calls", []):
        assert c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
    return {
        "reasoning_content": m.get("reasoning_content"),
        "content": m["content"] or None,
        "tool_calls": [dict(c["function"]) for c in m.get("tool_calls", [])],
        "finish_reason": choice["finish_reason"],
    }


@pytest.mark.parametrize(
    ("answer", "template", "config", "body", "expected"),
    [
        (
            HERMES_ANSWER,
            "hermes_tools.jinja",
            {},
            {"tools": TOOLS},
            {
                "reasoning_content": "The user wants weather.",
                "content": "\n\nChecking.\n",
                "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}],
                "finish_reason": "tool_calls",
            },
        ),
        (
            '<|python_tag|>{"name": "get_time", "parameters": {}}',
            "llama3_json.jinja",
            {"tool_call_parser": "llama3_json", "reasoning_parser": None},
            {"tools": TOOLS},
            {
                "reasoning_content": None,
                "content": None,
                "tool_calls": [{"name": "get_time", "arguments": "{}"}],
                "finish_reason": "tool_calls",
            },
        ),
        (
            'Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {}}]',
            "mistral_tools.jinja",
            {"tool_call_parser": "mistral", "reasoning_parser": None},
            {"tools": TOOLS},
            {
                "reasoning_content": None,
                "content": "Sure.",
                "tool_calls": [{"name": "get_time", "arguments": "{}"}],
                "finish_reason": "tool_calls",
            },
        ),
        (
            '<think>ok</think>[{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
            "hermes_tools.jinja",
            {},
            {"tools": TOOLS, "tool_choice": "required"},
            {
                "reasoning_content": "ok",
                "content": None,
                "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}],
                "finish_reason": "tool_calls",
            },
        ),
        (
            '{"city": "Oslo"}',
            "hermes_tools.jinja",
            {"reasoning_parser": None},
            {
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
            {
                "reasoning_content": None,
                "content": None,
                "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}],
                "finish_reason": "stop",  # vLLM: a named call ends as the engine says
            },
        ),
        (
            "No tools needed.",
            "hermes_tools.jinja",
            {},
            {"tools": TOOLS},
            {
                "reasoning_content": None,
                "content": "No tools needed.",
                "tool_calls": [],
                "finish_reason": "stop",
            },
        ),
    ],
)
def test_answers_whole_and_streamed_agree(
    answer: str, template: str, config: dict[str, Any], body: dict[str, Any], expected: Any
) -> None:
    app = _app(AnswerLLM(answer, template), **config)
    whole = _chat(app, **body).json()
    assert _whole(whole["choices"][0]) == expected
    # vLLM leaves an empty call list out of the message
    assert ("tool_calls" in whole["choices"][0]["message"]) == bool(expected["tool_calls"])
    events = _events(_chat(app, stream=True, **body))
    assert _assembled(events) == expected
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_a_plain_answer_keeps_openais_two_field_message() -> None:
    app = _app(
        AnswerLLM("hello"),
        tool_call_parser=None,
        enable_auto_tool_choice=False,
        reasoning_parser=None,
    )
    assert _chat(app).json()["choices"][0]["message"] == {"role": "assistant", "content": "hello"}


def test_a_named_call_cut_by_the_length_limit_keeps_length() -> None:
    app = _app(AnswerLLM('{"city": "Oslo"}'), reasoning_parser=None)
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = _chat(app, tools=TOOLS, tool_choice=named, max_tokens=4).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"ci'


def test_required_moves_each_tools_defs_to_the_root() -> None:
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    with_defs = {
        "type": "function",
        "function": {
            "name": "plot",
            "parameters": {
                "type": "object",
                "properties": {"at": {"$ref": "#/$defs/Point"}},
                "$defs": {"Point": point},
            },
        },
    }
    llm = AnswerLLM("x")
    _chat(_app(llm, reasoning_parser=None), tools=[with_defs], tool_choice="required")
    schema = json.loads(_constraint(llm).json)
    assert schema["$defs"] == {"Point": strict_json_schema(point)}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    other = {"type": "function", "function": json.loads(json.dumps(with_defs["function"]))}
    other["function"]["name"] = "plot2"
    other["function"]["parameters"]["$defs"]["Point"] = {"type": "string"}
    body = {"tools": [with_defs, other], "tool_choice": "required"}
    assert "Point" in _error(_chat(_app(llm), **body), 400, "tools")
