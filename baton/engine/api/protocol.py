"""The OpenAI-compatible wire format's requests, as vLLM accepts them: the request models, their
conversion to the engine's `SamplingParams`, and the error body's model (for the OpenAPI
document; `baton.errors.APIError` makes the bodies).

Nothing here touches the engine or the network, so every shape is testable on its own; the
response side is in `responses`.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from baton.engine.sampling_params import SamplingParams
from baton.errors import APIError

# ---- errors --------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body (`error.message` is what clients show), with vLLM's `object`."""

    object: Literal["error"] = "error"
    error: ErrorInfo


def random_id() -> str:
    return uuid.uuid4().hex


# ---- requests ------------------------------------------------------------------------------


class OpenAIBaseModel(BaseModel):
    # Fields this server does not know are ignored, as OpenAI clients add new ones often.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


TokenIds = list[Annotated[int, Field(ge=0)]]
# What the engine's wire format carries: larger integers cannot reach the EngineCore.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
MAX_N = 128  # OpenAI's bound; n samples are n engine requests, so n is a cost a client sets


class _GenerationRequest(OpenAIBaseModel):
    """The sampling fields shared by completions and chat completions."""

    model: str | None = None
    n: Annotated[int, Field(le=MAX_N)] = 1
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
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool = True
    priority: Int64 = 0
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


class FunctionDefinition(OpenAIBaseModel):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ChatCompletionTool(OpenAIBaseModel):
    """One entry of `tools`: only function tools, as OpenAI's chat API and vLLM have."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCallParam(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as the API returned it


class ToolCallParam(OpenAIBaseModel):
    """A call in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, reasoning_content, ... go to the template

    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None

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
        if self.tool_calls is not None:
            # Templates index the arguments (`tool_call.arguments | items`): vLLM gives them a
            # dict, parsed from the JSON text the API sent.
            message["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        return message


def _template_call(call: ToolCallParam) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError as e:
        raise APIError(
            400, f"tool_calls[].function.arguments is not valid JSON: {e}", "messages"
        ) from None
    out = call.model_dump(exclude_none=True)
    out["function"]["arguments"] = arguments
    return out


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
# chat_template_kwargs may not set these: the server renders them itself (and a template sent
# this way would pass by the --trust-request-chat-template check).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "documents", "chat_template", "tokenize", "add_generation_prompt"}
)


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without (vLLM)
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        self._check_common()
        self._check_tools()
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(
                400, "response_format other than text is not supported", "response_format"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")

    def _check_tools(self) -> None:
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise APIError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise APIError(400, "tools must have distinct function names", "tools")
        for i, tool in enumerate(self.tools or []):
            params = tool.function.parameters
            if params is not None and params.get("type", "object") != "object":
                raise APIError(
                    400, f"tools[{i}].function.parameters must be an object schema", "tools"
                )
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise APIError(
                400,
                f"Tool '{choice.function.name}' has not been passed in `tools`.",
                "tool_choice",
            )
        for key in sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {})):
            raise APIError(400, f"chat_template_kwargs may not set {key!r}", "chat_template_kwargs")

    def effective_tool_choice(self) -> Literal["none", "auto", "required"] | NamedToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """`tools` as the chat template sees them (vLLM passes them with tool_choice none too)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

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


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: TokenIds


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
