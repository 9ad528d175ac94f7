"""The OpenAI-compatible wire format's responses, as vLLM serves them: response and stream chunk
models, logprob formatting, and the pure conversions from the engine's `RequestOutput`.

Nothing here touches the engine or the network, so every shape is testable on its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer
from pydantic_core import to_json

from baton.engine.api import tools
from baton.engine.api.protocol import ChatCompletionRequest, CompletionRequest
from baton.engine.outputs import CompletionOutput, Logprob, RequestOutput

# ---- responses -----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(BaseModel):
    """One token's logprob in vLLM's `prompt_logprobs` (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per prompt token, None for the first (nothing predicts it).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class _Envelope(BaseModel):
    """The fields every completion response and chunk opens with, in OpenAI's order; each
    subclass pins `object` to its own literal."""

    id: str
    object: str
    created: int
    model: str


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatLogprobEntry] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: str = "assistant"  # the last message's, without a generation prompt (`response_role`)
    content: str | None = None
    # vLLM's field; `reasoning` mirrors it (vLLM's newer name), both None without a parser.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # The reasoning fields appear when the request used a reasoning parser (a plain chat
        # answer keeps OpenAI's two-field message); `tool_calls` when there are calls, as vLLM
        # leaves an empty list out.
        data: dict[str, Any] = handler(self)
        optional = ("reasoning_content", "reasoning")
        data = {k: v for k, v in data.items() if k not in optional or k in self.model_fields_set}
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed call: the first has index, id, type and name, the rest argument
    text only (OpenAI's format; a chunk leaves out what it does not set)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class CompletionChunk(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "baton"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


DONE = "data: [DONE]\n\n"


def sse(event: CompletionChunk | ChatCompletionChunk) -> str:
    """One server-sent event; unset fields are left out, as vLLM's chunks leave them out."""
    event.model_fields_set.add("object")  # a default, but OpenAI's chunks always carry it
    return f"data: {event.model_dump_json(exclude_unset=True)}\n\n"


# Stand for a chunk's text and token ids while `TextEvents` renders it: control characters no
# text a model makes holds together, and an id past any vocabulary.
_MARK = "\x00\x01baton-text\x01\x00"
_MARK_JSON = to_json(_MARK).decode()
_ID_MARK = [0x7EA7_BA70_BA70]
_ID_MARK_JSON = to_json(_ID_MARK).decode()


class TextEvents:
    """The events of one choice of a stream that carry new text, and with `return_token_ids`
    its token ids, and nothing else that changes (no finish reason, logprobs or per-chunk
    usage): most of a stream's events, and all but the last of those the router asks for
    (it streams with `return_token_ids`). `render(text, token_ids)` makes such an event through
    the chunk's models; it runs once, with markers for the two, and every event after splices
    its text's and ids' JSON (pydantic's own encoder) into what it made. The bytes are the
    same at a fraction of the cost: about 0.2 µs an event against 7 µs through the models
    (`tests/engine/api/test_responses.py` checks both agree).

    None from `make` when a marker does not come out exactly once, in order (a field that
    holds one): such a stream renders every event through the models."""

    def __init__(self, head: str, middle: str, tail: str | None) -> None:
        self._head, self._middle, self._tail = head, middle, tail

    @classmethod
    def make(cls, render: Callable[[str, list[int]], str], with_ids: bool) -> TextEvents | None:
        event = render(_MARK, _ID_MARK)
        head, found, rest = event.partition(_MARK_JSON)
        if not found or _MARK_JSON in rest:
            return None
        if not with_ids:
            return cls(head, rest, None)
        middle, found, tail = rest.partition(_ID_MARK_JSON)
        if not found or _ID_MARK_JSON in tail or _ID_MARK_JSON in head:
            return None
        return cls(head, middle, tail)

    def __call__(self, text: str, token_ids: list[int]) -> str:
        if self._tail is None:
            return self._head + to_json(text).decode() + self._middle
        ids = to_json(token_ids).decode()
        return self._head + to_json(text).decode() + self._middle + ids + self._tail


# ---- logprobs ------------------------------------------------------------------------------

DecodeToken = Callable[[int], str]
TokenBytes = Callable[[int], bytes]

# JSON has no -inf (and the JSON response refuses it: a 500): a token a mask or the model rules
# out (allowed_token_ids, a grammar, a prompt token) gets vLLM's stand-in.
_MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def token_id_str(token: int) -> str:
    """A token as vLLM's `return_tokens_as_token_ids` shows it in logprobs: its id, which
    survives where its text alone would not (a byte of a character, say)."""
    return f"token_id:{token}"


def _token_str(token: int, entry: dict[int, Logprob], decode: DecodeToken) -> str:
    if decode is token_id_str:  # the text the engine decoded is not wanted
        return decode(token)
    lp = entry.get(token)
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return decode(token)


def _top(entry: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The `num` most likely tokens of one position, most likely first."""
    ranked = [(t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= num]
    return sorted(ranked, key=lambda item: item[1].rank or 0)[:num]


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob] | None],
    num_top: int,
    text_offset: int,
    decode: DecodeToken,
) -> tuple[CompletionLogProbs, int]:
    """OpenAI's legacy logprobs for these tokens, and the text offset after them.

    `top_logprobs` holds the `num_top` most likely tokens plus the sampled one, as vLLM does;
    an entry of None (a prompt token, echoed) has no logprobs.
    """
    tokens: list[str] = []
    offsets: list[int] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    for token, entry in zip(token_ids, entries, strict=False):
        if entry is None:
            text = decode(token)
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            text = _token_str(token, entry, decode)
            sampled = entry.get(token)
            token_logprobs.append(_finite(sampled.logprob) if sampled else None)
            top = {
                _token_str(t, entry, decode): _finite(lp.logprob) for t, lp in _top(entry, num_top)
            }
            if sampled is not None:
                top.setdefault(text, _finite(sampled.logprob))
            top_logprobs.append(top)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
    result = CompletionLogProbs(
        text_offset=offsets, token_logprobs=token_logprobs, tokens=tokens, top_logprobs=top_logprobs
    )
    return result, text_offset


def prompt_logprobs_of(out: RequestOutput, decode: DecodeToken) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs`: per prompt token its own and the top tokens' logprobs, ranks
    and text; None unless the request asked for them."""
    if out.prompt_logprobs is None:
        return None
    shown: PromptLogprobs = []
    for entry in out.prompt_logprobs:
        if entry is None:
            shown.append(None)
            continue
        shown.append(
            {
                t: PromptLogprob(
                    logprob=_finite(lp.logprob),
                    rank=lp.rank,
                    decoded_token=lp.decoded_token if lp.decoded_token is not None else decode(t),
                )
                for t, lp in entry.items()
            }
        )
    return shown


def prompt_entries(out: RequestOutput) -> list[dict[int, Logprob] | None]:
    """The echoed prompt's logprob entries, one per prompt token (None where there are none:
    the first token, or every token when the engine computed none)."""
    n = len(out.prompt_token_ids)
    if out.prompt_logprobs is None or len(out.prompt_logprobs) != n:
        return [None] * n
    return list(out.prompt_logprobs)


def chat_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob]],
    num_top: int,
    decode: DecodeToken,
    token_bytes: TokenBytes | None = None,
) -> ChatLogProbs:
    """OpenAI's chat logprobs: per token its logprob, bytes and the `num_top` most likely. With
    `token_bytes`, a token whose text is U+FFFD (part of a character) shows its own bytes, so
    that a client joining them gets the character, as OpenAI means `bytes` for."""

    def bytes_of(token: int, text: str) -> list[int]:
        if token_bytes is not None and "\ufffd" in text:
            return list(token_bytes(token))
        return list(text.encode())

    content = []
    for token, entry in zip(token_ids, entries, strict=False):
        text = _token_str(token, entry, decode)
        sampled = entry.get(token)
        top = [
            TopLogprob(token=s, logprob=_finite(lp.logprob), bytes=bytes_of(t, s))
            for t, s, lp in (
                (t, _token_str(t, entry, decode), lp) for t, lp in _top(entry, num_top)
            )
        ]
        content.append(
            ChatLogprobEntry(
                token=text,
                logprob=_finite(sampled.logprob) if sampled else _MIN_LOGPROB,
                bytes=bytes_of(token, text),
                top_logprobs=top,
            )
        )
    return ChatLogProbs(content=content)


# ---- streaming -----------------------------------------------------------------------------


@dataclass
class Delta:
    """What one sample added since the last chunk."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class SampleCursor:
    """How much of one sample a stream has sent.

    While a sample runs, the last `holdback` characters stay unsent: they may be the start of
    a stop string, which is cut from the text once it completes.
    """

    holdback: int = 0
    text_sent: int = 0
    tokens_sent: int = 0
    finished: bool = False
    started: bool = False  # a chunk of this sample went out
    text_offset: int = 0  # where the next token's text starts (completions' logprobs)

    def advance(self, sample: CompletionOutput) -> Delta | None:
        """The new part of a cumulative snapshot, or None when there is nothing to send."""
        if self.finished:
            return None
        done = sample.finish_reason is not None
        end = len(sample.text) if done else max(self.text_sent, len(sample.text) - self.holdback)
        text = sample.text[self.text_sent : end]
        num_tokens = len(sample.token_ids)
        if not done and not text and num_tokens == self.tokens_sent:
            return None
        token_ids = list(sample.token_ids[self.tokens_sent : num_tokens])
        logprobs = None
        if sample.logprobs is not None:
            logprobs = list(sample.logprobs[self.tokens_sent : num_tokens])
        self.text_sent, self.tokens_sent, self.finished = end, num_tokens, done
        self.started = True
        return Delta(text, token_ids, logprobs, sample.finish_reason, sample.stop_reason)

    def resume(self, num_tokens: int, text: str, text_offset: int = 0) -> None:
        """Starts where the stream of the engine that began the answer left off, once it had
        sent `num_tokens` tokens, whose text is `text` (a resumed answer): it had sent all of
        it but the holdback (the text only grew, so its last chunk sent up to there), its
        first chunk went out, and `text_offset` is where its next token's text starts."""
        self.tokens_sent = num_tokens
        self.text_sent = max(0, len(text) - self.holdback)
        self.started = True
        self.text_offset = text_offset


def stop_holdback(stop: Sequence[str]) -> int:
    return max((len(s) for s in stop), default=1) - 1


# ---- whole responses -----------------------------------------------------------------------


def usage_of(outputs: Sequence[RequestOutput], prompt_tokens_details: bool = True) -> UsageInfo:
    """The usage of every prompt; `prompt_tokens_details` (vLLM's
    --enable-prompt-tokens-details) adds how many prompt tokens the prefix cache held."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(s.token_ids) for o in outputs for s in o.outputs)
    details = None
    if prompt_tokens_details:
        # Prompt tokens only: a resumed answer's cache hits may reach into its output.
        cached = sum(min(o.num_cached_tokens, len(o.prompt_token_ids)) for o in outputs)
        details = PromptTokensDetails(cached_tokens=cached)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=details,
    )


def running_usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    """A chunk's usage under `continuous_usage_stats`: its prompt and its sample so far."""
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def completion_response(
    request: CompletionRequest,
    response_id: str,
    created: int,
    model: str,
    outputs: Sequence[RequestOutput],
    decode: DecodeToken,
    prompt_tokens_details: bool = True,
) -> CompletionResponse:
    """The non-streaming answer to a batch of prompts; choice i*n + j is sample j of prompt i.

    With `echo` the prompt leads the text (and its logprobs the logprobs); with `echo` and
    `max_tokens=0` the prompt is the whole answer, as vLLM's serving_completion shapes it.
    """
    choices = []
    echo_only = request.echo_only()
    for i, out in enumerate(outputs):
        # The server gives an echoed prompt its text (token ids decoded), as the stream reads it.
        prefix = (out.prompt or "") if request.echo else ""
        shown_prompt_logprobs = prompt_logprobs_of(out, decode)
        for sample in out.outputs:
            logprobs = None
            if request.logprobs is not None:
                ids: list[int] = []
                entries: list[dict[int, Logprob] | None] = []
                if request.echo:
                    ids += out.prompt_token_ids
                    entries += prompt_entries(out)
                if not echo_only:
                    ids += sample.token_ids
                    entries += list(sample.logprobs or [])
                logprobs, _ = completion_logprobs(ids, entries, request.logprobs, 0, decode)
            choices.append(
                CompletionChoice(
                    index=i * request.n + sample.index,
                    text=prefix if echo_only else prefix + sample.text,
                    logprobs=logprobs,
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                    prompt_logprobs=shown_prompt_logprobs,
                    prompt_token_ids=out.prompt_token_ids if request.return_token_ids else None,
                    token_ids=list(sample.token_ids) if request.return_token_ids else None,
                )
            )
    return CompletionResponse(
        id=response_id,
        created=created,
        model=model,
        choices=choices,
        usage=usage_of(outputs, prompt_tokens_details),
        kv_transfer_params=outputs[0].kv_transfer_params if len(outputs) == 1 else None,
    )


def chat_response(
    request: ChatCompletionRequest,
    response_id: str,
    created: int,
    model: str,
    out: RequestOutput,
    decode: DecodeToken,
    mode: tools.OutputMode | None = None,  # None: the text is all content
    *,
    prompt_tokens_details: bool = True,
    token_bytes: TokenBytes | None = None,
) -> ChatCompletionResponse:
    choices = []
    for sample in out.outputs:
        logprobs = None
        if request.logprobs:
            logprobs = chat_logprobs(
                sample.token_ids,
                sample.logprobs or [],
                request.top_logprobs or 0,
                decode,
                token_bytes,
            )
        finish = sample.finish_reason
        if mode is None:
            message = AssistantMessage(content=sample.text)
        else:
            message, finish = chat_message(mode, sample.text, finish)
        message.role = request.response_role()
        if echoed := request.echoed_text():
            message.content = echoed + (message.content or "")
        if not request.include_reasoning:
            message.reasoning_content = message.reasoning = None
        choices.append(
            ChatChoice(
                index=sample.index,
                message=message,
                logprobs=logprobs,
                finish_reason=finish,
                stop_reason=sample.stop_reason,
                token_ids=list(sample.token_ids) if request.return_token_ids else None,
            )
        )
    return ChatCompletionResponse(
        id=response_id,
        created=created,
        model=model,
        choices=choices,
        usage=usage_of([out], prompt_tokens_details),
        prompt_logprobs=prompt_logprobs_of(out, decode),
        prompt_token_ids=out.prompt_token_ids if request.return_token_ids else None,
        kv_transfer_params=out.kv_transfer_params,
    )


def chat_message(
    mode: tools.OutputMode, text: str, finish_reason: str | None
) -> tuple[AssistantMessage, str | None]:
    """One sample's message with its reasoning and calls parsed out, and its finish reason."""
    whole = tools.ChoiceParser(mode).message(text)
    fields: dict[str, Any] = {"content": whole.content}
    if mode.reasoning is not None:
        fields["reasoning_content"] = fields["reasoning"] = whole.reasoning
    if mode.tool_parser is not None:
        fields["tool_calls"] = [
            ToolCall(id=i, function=FunctionCall(name=c.name, arguments=c.arguments))
            for i, c in whole.calls
        ]
    reason = tools.finish_reason(mode, bool(whole.calls), finish_reason)
    return AssistantMessage(**fields), reason


def delta_message(delta: tools.MessageDelta) -> DeltaMessage:
    """A stream chunk's delta: only what this step added (unset fields stay out of the chunk)."""
    fields: dict[str, Any] = {}
    if delta.reasoning:
        fields["reasoning_content"] = fields["reasoning"] = delta.reasoning
    if delta.content:
        fields["content"] = delta.content
    if delta.calls:
        fields["tool_calls"] = [
            DeltaToolCall(
                index=c.index,
                id=c.id,
                type="function",
                function=DeltaFunctionCall(name=c.name, arguments=c.arguments),
            )
            if c.id is not None
            else DeltaToolCall(index=c.index, function=DeltaFunctionCall(arguments=c.arguments))
            for c in delta.calls
        ]
    return DeltaMessage(**fields)
