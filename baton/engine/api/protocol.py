"""The OpenAI-compatible wire format, as vLLM serves it: request and response models, and the
pure conversions between them and the engine's `SamplingParams` and `RequestOutput`.

Nothing here touches the engine or the network, so every shape is testable on its own.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from baton.engine.outputs import CompletionOutput, Logprob, RequestOutput
from baton.engine.sampling_params import SamplingParams

# ---- errors --------------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "RequestEntityTooLarge",
    429: "TooManyRequests",
    500: "InternalServerError",
    503: "ServiceUnavailable",
}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body (`error.message` is what clients show), with vLLM's `object`."""

    object: Literal["error"] = "error"
    error: ErrorInfo


class APIError(Exception):
    """An error a client caused or must be told about; becomes an `ErrorResponse`."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def response(self) -> ErrorResponse:
        kind = _ERROR_TYPES.get(self.status, "InternalServerError")
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.status)
        )

    @classmethod
    def from_value_error(cls, error: ValueError, param: str | None = None) -> APIError:
        """A 400 for a `ValueError` whose message starts with the field it names."""
        match = re.match(r"(\w+)(\[\])? must", str(error))
        return cls(400, str(error), param or (match.group(1) if match else None))


def random_id() -> str:
    return uuid.uuid4().hex


# ---- requests ------------------------------------------------------------------------------


class OpenAIBaseModel(BaseModel):
    # Fields this server does not know are ignored, as OpenAI clients add new ones often.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


TokenIds = list[Annotated[int, Field(ge=0)]]


class _GenerationRequest(OpenAIBaseModel):
    """The sampling fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None
    return_token_ids: bool = False
    kv_transfer_params: dict[str, Any] | None = None

    def _check_common(self) -> None:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "stream_options can only be set when stream is true", "stream_options"
            )

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """vLLM's defaults for what the request leaves out; range errors become 400s."""
        defaults: dict[str, float] = {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
        }
        values = {
            k: d if getattr(self, k) is None else getattr(self, k) for k, d in defaults.items()
        }
        try:
            return SamplingParams(
                n=self.n,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                seed=self.seed,
                stop=self.stop_list(),
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                **values,  # type: ignore[arg-type]
            )
        except ValueError as e:
            raise APIError.from_value_error(e) from None


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int | None = None  # None: 16, as OpenAI and vLLM default
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    def check(self) -> None:
        """Rejects what the server does not support, naming the field."""
        self._check_common()
        if self.suffix is not None:
            raise APIError(400, "suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of is not supported", "best_of")

    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt, text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            batch: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            batch = [[x for x in p if isinstance(x, int)]]
        else:
            batch = [x for x in p if not isinstance(x, int)]
        if not batch or any(len(x) == 0 for x in batch):
            raise APIError(400, "prompt must not be empty", "prompt")
        return batch

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        return self._sampling_params(max_tokens, self.logprobs)


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... go to the template

    role: str
    content: str | list[ContentPart] | None = None

    def to_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400, f"content of type {part.type!r} is not supported", "messages"
                    )
                texts.append(part.text)
            message["content"] = "\n".join(texts)
        elif self.content is None:
            message["content"] = ""
        return message


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None

    def check(self) -> None:
        self._check_common()
        if self.tools:
            raise APIError(400, "tools are not supported", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(
                400, "response_format other than text is not supported", "response_format"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")

    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._sampling_params(max_tokens, logprobs)
        except APIError as e:
            if e.param == "logprobs":
                e.param = "top_logprobs"
            raise


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: a `prompt` or chat `messages` (vLLM's two shapes in one)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str


def resolve_max_tokens(
    requested: int | None,
    default: int | None,
    prompt_len: int,
    max_model_len: int,
    prompt_param: str,
    param: str = "max_tokens",
) -> int:
    """How many tokens to generate: what was asked, else `default`, else all that fit.

    A prompt that leaves no room, or an explicit request past the room left, is a 400 naming
    the limit and the length.
    """
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {prompt_len} tokens, which leaves no room for a completion. Please "
            "reduce the length of the prompt.",
            prompt_param,
        )
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise APIError(
            400,
            f"'{param}' is too large: {requested}. This model's maximum context length is "
            f"{max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({requested} > {max_model_len} - {prompt_len}).",
            param,
        )
    return requested


# ---- responses -----------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


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
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatLogprobEntry] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
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


DONE = "data: [DONE]\n\n"


def sse(event: CompletionChunk | ChatCompletionChunk) -> str:
    """One server-sent event; unset fields are left out, as vLLM's chunks leave them out."""
    event.model_fields_set.add("object")  # a default, but OpenAI's chunks always carry it
    return f"data: {event.model_dump_json(exclude_unset=True)}\n\n"


def sse_error(error: APIError) -> str:
    return f"data: {error.response().model_dump_json()}\n\n"


# ---- logprobs ------------------------------------------------------------------------------

DecodeToken = Callable[[int], str]


def _token_str(token: int, entry: dict[int, Logprob], decode: DecodeToken) -> str:
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
            token_logprobs.append(sampled.logprob if sampled else None)
            top = {_token_str(t, entry, decode): lp.logprob for t, lp in _top(entry, num_top)}
            if sampled is not None:
                top.setdefault(text, sampled.logprob)
            top_logprobs.append(top)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
    result = CompletionLogProbs(
        text_offset=offsets, token_logprobs=token_logprobs, tokens=tokens, top_logprobs=top_logprobs
    )
    return result, text_offset


def chat_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob]],
    num_top: int,
    decode: DecodeToken,
) -> ChatLogProbs:
    """OpenAI's chat logprobs: per token its logprob, bytes and the `num_top` most likely."""
    content = []
    for token, entry in zip(token_ids, entries, strict=False):
        text = _token_str(token, entry, decode)
        sampled = entry.get(token)
        top = [
            TopLogprob(token=s, logprob=lp.logprob, bytes=list(s.encode()))
            for s, lp in ((_token_str(t, entry, decode), lp) for t, lp in _top(entry, num_top))
        ]
        content.append(
            ChatLogprobEntry(
                token=text,
                logprob=sampled.logprob if sampled else float("-inf"),
                bytes=list(text.encode()),
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


def stop_holdback(stop: Sequence[str]) -> int:
    return max((len(s) for s in stop), default=1) - 1


# ---- whole responses -----------------------------------------------------------------------


def usage_of(outputs: Sequence[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(s.token_ids) for o in outputs for s in o.outputs)
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def completion_response(
    request: CompletionRequest,
    response_id: str,
    created: int,
    model: str,
    outputs: Sequence[RequestOutput],
    decode: DecodeToken,
) -> CompletionResponse:
    """The non-streaming answer to a batch of prompts; choice i*n + j is sample j of prompt i."""
    choices = []
    for i, out in enumerate(outputs):
        prefix = ""
        if request.echo:
            prefix = (
                out.prompt if out.prompt is not None else _decode_all(out.prompt_token_ids, decode)
            )
        for sample in out.outputs:
            logprobs = None
            if request.logprobs is not None:
                ids: list[int] = []
                entries: list[dict[int, Logprob] | None] = []
                if request.echo:
                    ids += out.prompt_token_ids
                    entries += [None] * len(out.prompt_token_ids)
                ids += sample.token_ids
                entries += list(sample.logprobs or [])
                logprobs, _ = completion_logprobs(ids, entries, request.logprobs, 0, decode)
            choices.append(
                CompletionChoice(
                    index=i * request.n + sample.index,
                    text=prefix + sample.text,
                    logprobs=logprobs,
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                    prompt_token_ids=out.prompt_token_ids if request.return_token_ids else None,
                    token_ids=list(sample.token_ids) if request.return_token_ids else None,
                )
            )
    return CompletionResponse(
        id=response_id, created=created, model=model, choices=choices, usage=usage_of(outputs)
    )


def chat_response(
    request: ChatCompletionRequest,
    response_id: str,
    created: int,
    model: str,
    out: RequestOutput,
    decode: DecodeToken,
) -> ChatCompletionResponse:
    choices = []
    for sample in out.outputs:
        logprobs = None
        if request.logprobs:
            logprobs = chat_logprobs(
                sample.token_ids, sample.logprobs or [], request.top_logprobs or 0, decode
            )
        choices.append(
            ChatChoice(
                index=sample.index,
                message=AssistantMessage(content=sample.text),
                logprobs=logprobs,
                finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason,
                token_ids=list(sample.token_ids) if request.return_token_ids else None,
            )
        )
    return ChatCompletionResponse(
        id=response_id,
        created=created,
        model=model,
        choices=choices,
        usage=usage_of([out]),
        prompt_token_ids=out.prompt_token_ids if request.return_token_ids else None,
    )


def _decode_all(token_ids: Sequence[int], decode: DecodeToken) -> str:
    return "".join(decode(t) for t in token_ids)
