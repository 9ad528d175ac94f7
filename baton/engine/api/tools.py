"""Tool calling and reasoning on the chat route, between the request and the engine and between
the engine's text and the chat message.

Request side: which parser reads the answer (`OutputMode`), and the grammar a forced tool
choice needs (vLLM's: `required` is a JSON list of `{"name", "parameters"}` objects, at least
one, at most one without parallel calls; a named function is its parameters' schema), started
after the reasoning (`after_token_ids` = `</think>`'s ids) unless the prompt closed it.

Answer side: `ChoiceParser` turns one sample's text into reasoning, content and calls, whole
(`message`) or as the stream's deltas (`advance`); both run the same parsers, the stream on each
growing prefix, so the deltas add up to the whole answer.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from baton.engine.api.protocol import ChatCompletionRequest, NamedToolChoice
from baton.engine.api.reasoning import ReasoningParser, ThinkState
from baton.engine.api.tool_parsers import (
    NamedToolParser,
    Parsed,
    ParsedCall,
    RequiredToolParser,
    ToolParser,
)
from baton.engine.sampling_params import StructuredOutputsParams
from baton.engine.structured.backend import strict_json_schema
from baton.errors import APIError

AUTO_TOOLS_MESSAGE = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's form


def _parameters(req: ChatCompletionRequest, name: str) -> dict[str, Any]:
    """A tool's parameter schema as a forced call's grammar takes it: objects that say nothing
    of other properties allow none (where vLLM leaves them open). A call's arguments are the
    function's; keys it does not declare are no use to it, and a free key lets a weak model
    write names and values until max_tokens, so that no call ever completes."""
    for tool in req.tools or []:
        if tool.function.name == name:
            return strict_json_schema(tool.function.parameters or _EMPTY_PARAMETERS)
    raise AssertionError(name)  # check() made sure the name is a tool


def forced_tool_schema(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema a required or named tool choice constrains the answer to; None for
    none/auto."""
    choice = req.effective_tool_choice()
    if isinstance(choice, NamedToolChoice):
        return _parameters(req, choice.function.name)
    if choice != "required":
        return None
    defs: dict[str, Any] = {}
    items = []
    for tool in req.tools or []:
        parameters = _parameters(req, tool.function.name)
        # A tool's `#/$defs/...` refs resolve from the root once its schema is nested in the
        # list's: its definitions move there (as vLLM does), and two tools may not disagree.
        for name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise APIError(400, f"tools define $defs/{name} differently; rename one", "tools")
        items.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                # Nothing else: free keys would let a weak model write long strings forever.
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass(frozen=True)
class ToolConfig:
    """The server's `--enable-auto-tool-choice`, `--tool-call-parser`, `--reasoning-parser`."""

    enable_auto_tool_choice: bool = False
    tool_parser: ToolParser | None = None
    reasoning_parser: ReasoningParser | None = None


@dataclass(frozen=True)
class OutputMode:
    """How one request's answers are read."""

    tool_parser: ToolParser | None  # None: no calls, all content
    forced: bool  # required or named: the grammar made it a call
    reasoning: ReasoningParser | None
    think_state: ThinkState
    parallel: bool = True  # False (`parallel_tool_calls: false`): the first call only


def output_mode(req: ChatCompletionRequest, config: ToolConfig, prompt: str) -> OutputMode:
    """The parsers of a request (its prompt rendered); auto without a parser is a 400."""
    choice = req.effective_tool_choice()
    parser: ToolParser | None = None
    if isinstance(choice, NamedToolChoice):
        parser = NamedToolParser(choice.function.name)
    elif choice == "required":
        parser = RequiredToolParser()
    elif choice == "auto" and req.tools:
        if not config.enable_auto_tool_choice or config.tool_parser is None:
            raise APIError(400, AUTO_TOOLS_MESSAGE, "tool_choice")
        parser = config.tool_parser
    reasoning = config.reasoning_parser
    state: ThinkState = "closed" if reasoning is None else reasoning.state_after(prompt)
    forced = isinstance(parser, (NamedToolParser, RequiredToolParser))
    return OutputMode(parser, forced, reasoning, state, req.parallel_tool_calls is not False)


def constraint(
    req: ChatCompletionRequest,
    mode: OutputMode,
    from_request: StructuredOutputsParams | None,
    think_end_ids: list[int] | None,
) -> StructuredOutputsParams | None:
    """The request's grammar: a forced tool choice's (which wins over response_format, as in
    vLLM), else the request's own; started after the reasoning when the answer may reason."""
    schema = forced_tool_schema(req)
    params = from_request
    if schema is not None:
        params = StructuredOutputsParams(json=json.dumps(schema))
    if params is None or mode.think_state == "closed" or not think_end_ids:
        return params
    return replace(params, after_token_ids=tuple(think_end_ids))


# ---- the answer ----------------------------------------------------------------------------


@dataclass
class CallDelta:
    index: int
    id: str | None  # the first delta of a call: its id, type and name
    name: str | None
    arguments: str


@dataclass
class MessageDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass
class Message:
    reasoning: str | None
    content: str | None
    calls: list[tuple[str, ParsedCall]]  # (id, call)


@dataclass
class ChoiceParser:
    """One sample's text as reasoning, content and calls."""

    mode: OutputMode
    reasoning_sent: int = 0
    content_sent: int = 0
    calls_sent: list[tuple[str, int]] = field(default_factory=list)  # (id, arguments sent)

    def _parse(self, text: str, final: bool) -> tuple[str | None, Parsed]:
        reasoning, content = None, text
        if self.mode.reasoning is not None:
            split = self.mode.reasoning.split(text, self.mode.think_state, final)
            reasoning, content = split.reasoning, split.content
        if self.mode.tool_parser is None:
            return reasoning, Parsed(content)
        parsed = self.mode.tool_parser.parse(content, final)
        if not self.mode.parallel and len(parsed.calls) > 1:
            # vLLM's answer to `parallel_tool_calls: false`: the calls after the first dropped.
            parsed = Parsed(parsed.content, parsed.calls[:1])
        return reasoning, parsed

    def message(self, text: str) -> Message:
        """The whole answer (what a non-streamed response says)."""
        reasoning, parsed = self._parse(text, final=True)
        content: str | None = parsed.content
        if parsed.calls and not parsed.content.strip():
            content = None  # only calls: no content, as vLLM
        elif reasoning is not None and not parsed.content:
            content = None
        return Message(reasoning, content, [(tool_call_id(), c) for c in parsed.calls])

    def advance(self, text: str, final: bool) -> MessageDelta:
        """What the answer so far (`text`, all of it when `final`) adds to what was sent."""
        reasoning, parsed = self._parse(text, final)
        delta = MessageDelta()
        if reasoning is not None and len(reasoning) > self.reasoning_sent:
            delta.reasoning = reasoning[self.reasoning_sent :]
            self.reasoning_sent = len(reasoning)
        content = parsed.content
        # Whitespace that may turn out to be all the content beside calls waits (the whole
        # answer says None then); it goes out with the first character after it, or at the end.
        hold = parsed.calls or self.mode.tool_parser is not None
        if final:
            whole = self.message(text)
            content = whole.content or ""
        elif hold and not content.strip():
            content = ""
        if len(content) > self.content_sent:
            delta.content = content[self.content_sent :]
            self.content_sent = len(content)
        for index, call in enumerate(parsed.calls):
            if index == len(self.calls_sent):
                self.calls_sent.append((tool_call_id(), 0))
                first = True
            else:
                first = False
            call_id, sent = self.calls_sent[index]
            if first or len(call.arguments) > sent:
                delta.calls.append(
                    CallDelta(
                        index,
                        call_id if first else None,
                        call.name if first else None,
                        call.arguments[sent:],
                    )
                )
                self.calls_sent[index] = (call_id, len(call.arguments))
        return delta

    @property
    def called(self) -> bool:
        return bool(self.calls_sent)


def finish_reason(mode: OutputMode, called: bool, engine_reason: str | None) -> str | None:
    """vLLM's (and OpenAI's): "tool_calls" when an auto choice called, or a required one
    stopped; a named choice ends as the engine says ("stop"), as does a call cut short."""
    if not called or engine_reason is None:
        return engine_reason
    if isinstance(mode.tool_parser, NamedToolParser):
        return engine_reason
    if isinstance(mode.tool_parser, RequiredToolParser) and engine_reason != "stop":
        return engine_reason
    return "tool_calls"
