"""Tool-call parsers (vLLM's `--tool-call-parser`): find the function calls in a chat answer's
text, in the format the model was trained to write them, and the content around them.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as many as the model
  writes (Qwen2.5, Qwen3, Hermes 2/3);
- `llama3_json`: an answer that is a JSON object `{"name": ..., "parameters": {...}}`, after an
  optional `<|python_tag|>`, several separated by `;` (Llama 3.1-3.3's JSON tool format);
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` objects.

Every parser is pure and works on a growing prefix: `parse(text, final=False)` returns only
what no continuation can change (content is a prefix of the final content, each call's name
is fixed once listed and its arguments only grow), so streaming the growth of each parse sends
exactly the final parse. A call whose JSON does not parse is left in the content as the model
wrote it (vLLM turns the whole answer to content then; per call is what a stream can keep).
Arguments are the JSON text of the parsed value, as vLLM's `json.dumps(..., ensure_ascii=False)`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from baton.engine.api.reasoning import partial_suffix

_DECODER = json.JSONDecoder()
_WS = " \t\r\n"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def call_of(obj: Any, args_keys: tuple[str, ...]) -> ParsedCall | None:
    """The call a parsed JSON value names, or None if it is not `{"name": str, <args>: ...}`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _skip(text: str, pos: int, chars: str = _WS) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


class ToolParser:
    name: ClassVar[str] = ""
    # The parser's markers are special tokens, which the detokenizer must keep in the text.
    needs_special_tokens: ClassVar[bool] = False

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - partial_suffix(tail, self.start)]
                content.append(self._between(tail, calls))
                break
            content.append(self._between(text[pos:i], calls))
            j = text.find(self.end, i + len(self.start))
            if j < 0 and not final:
                break  # an open call: nothing after its start is known yet
            stop = len(text) if j < 0 else j + len(self.end)
            body = text[i + len(self.start) : len(text) if j < 0 else j]
            call = self._call(body)
            if call is None:
                content.append(text[i:stop])
            else:
                calls.append(call)
            pos = stop
            if j < 0:
                break
        return Parsed("".join(content), calls)

    @staticmethod
    def _between(text: str, calls: list[ParsedCall]) -> str:
        # The newlines the model writes between and after calls are not content; until
        # something else follows, text after a call cannot be told from them.
        return "" if calls and not text.strip() else text

    @staticmethod
    def _call(body: str) -> ParsedCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        return call_of(obj, ("arguments", "parameters"))


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        lead = _skip(text, 0)
        rest = text[lead:]
        if rest.startswith(self.python_tag):
            pos = lead + len(self.python_tag)
        elif rest.startswith("{"):
            pos = lead
        elif not final and self.python_tag.startswith(rest):
            return Parsed("")  # the answer may still open with a call
        else:
            return Parsed(text)  # an answer that does not open with a call is all content
        calls: list[ParsedCall] = []
        while True:
            pos = _skip(text, pos, _WS + ";")
            if pos == len(text):
                return Parsed("", calls)
            try:
                obj, end = _DECODER.raw_decode(text, pos)
            except ValueError:
                obj, end = None, pos
            call = call_of(obj, ("parameters", "arguments")) if end > pos else None
            if call is None:
                if not final:
                    return Parsed("", calls)  # an unfinished object, or text the end decides
                # What does not parse is content: all of it if no call came before.
                return Parsed(text[pos:] if calls else text, calls)
            calls.append(call)
            pos = end


class MistralToolParser(ToolParser):
    name = "mistral"
    bot = "[TOOL_CALLS]"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        i = text.find(self.bot)
        if i < 0:
            cut = 0 if final else partial_suffix(text, self.bot)
            return Parsed(text[: len(text) - cut])
        pos = _skip(text, i + len(self.bot))
        try:
            obj, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            return Parsed(text if final else text[:i])
        items = obj if isinstance(obj, list) else [obj]
        calls = [call_of(item, ("arguments", "parameters")) for item in items]
        if not calls or any(c is None for c in calls):
            return Parsed(text if final else text[:i])
        return Parsed(text[:i] + text[end:].strip(), [c for c in calls if c is not None])


class RequiredToolParser(ToolParser):
    """`tool_choice: "required"`: the grammar made the answer a JSON list of
    `{"name", "parameters"}` objects (vLLM's shape); each is a call once it is complete."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        calls: list[ParsedCall] = []
        pos = _skip(text, 0)
        if pos < len(text) and text[pos] == "[":
            pos += 1
            while True:
                pos = _skip(text, pos)
                try:
                    obj, end = _DECODER.raw_decode(text, pos)
                except ValueError:
                    break
                call = call_of(obj, ("parameters", "arguments"))
                if call is None:
                    break
                calls.append(call)
                pos = _skip(text, end)
                if pos >= len(text) or text[pos] != ",":
                    break
                pos += 1
        if final and not calls:
            return Parsed(text)  # cut short before any call: the text is all there is
        return Parsed("", calls)


class NamedToolParser(ToolParser):
    """A named `tool_choice`: the grammar made the whole answer that function's arguments,
    streamed as they come (vLLM sends them raw too)."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", [ParsedCall(self.function, text)])


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; expected one of {sorted(TOOL_PARSERS)}"
        ) from None
