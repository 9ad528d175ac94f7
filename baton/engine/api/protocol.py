"""The OpenAI-compatible wire format's requests, as vLLM accepts them: the request models, their
conversion to the engine's `SamplingParams`, and the error body's model (for the OpenAPI
document; `baton.errors.APIError` makes the bodies).

Nothing here touches the engine or the network, so every shape is testable on its own; the
response side is in `responses`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from baton.engine.sampling_params import SamplingParams, StructuredOutputsParams
from baton.engine.structured.backend import strict_json_schema
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
    # vLLM's: every chunk carries the usage so far (with include_usage only)
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIBaseModel):
    """`response_format.json_schema`: OpenAI's `schema` is a pydantic name, hence the alias."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's `response_format`, with vLLM's `structural_tag` type (whose own fields,
    `structures` and `triggers` or `format`, are kept as they came)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` object: one constraint kind, and its options (those this
    engine has no use for are accepted and ignored, as vLLM's other backends ignore them)."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    whitespace_pattern: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


# vLLM's backends; a request may name one (deprecated in vLLM, which then ignores it), but a name
# no backend has is a mistake the client should hear of.
GUIDED_DECODING_BACKENDS = (
    "auto",
    "guidance",
    "llguidance",
    "xgrammar",
    "outlines",
    "lm-format-enforcer",
)


TokenIds = list[Annotated[int, Field(ge=0)]]
# What the engine's wire format carries: larger integers cannot reach the EngineCore.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
MAX_N = 128  # OpenAI's bound; n samples are n engine requests, so n is a cost a client sets
MAX_STOP_STRINGS = 4  # OpenAI's bound, and vLLM's (its VLLM_MAX_STOP_STRINGS)


class _GenerationRequest(OpenAIBaseModel):
    """The sampling fields shared by completions and chat completions."""

    model: str | None = None
    n: Annotated[int, Field(le=MAX_N)] = 1
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
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
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] = Field(default_factory=list)
    prompt_logprobs: int | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the model takes)
    truncate_prompt_tokens: Int64 | None = None
    use_beam_search: bool = False  # vLLM's; refused rather than ignored
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs show "token_id:<id>"
    structured_outputs: StructuredOutputsRequest | None = None
    # Baton's: resume an answer another engine began (the router's mid-stream migration). The
    # output token ids the client already got; the answer goes on as if this engine had
    # produced them (max_tokens and min_tokens count them, prompt logprobs and the echo are
    # not sent again, a seed is derived from the original and the position), and a stream sends
    # only what the client does not have yet: not the first chunk's fields (a chat stream's
    # role chunk, prompt_token_ids), even for an empty list. One prompt and n=1.
    resume_token_ids: TokenIds | None = None
    # vLLM's: starts the chain of the prompt's prefix-cache block hashes, so that requests
    # with different salts (tenants) never share cached blocks, nor learn from their time to
    # first token what another's prompts were.
    cache_salt: str | None = None
    # vLLM's older names for structured outputs (deprecated there, still sent by clients)
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    def _check_common(self) -> None:
        if self.use_beam_search:
            raise APIError(400, "beam search is not supported", "use_beam_search")
        k = self.truncate_prompt_tokens
        if k is not None and (k == 0 or k < -1):
            raise APIError(
                400,
                f"truncate_prompt_tokens must be an integer >= 1 or -1, got {k}",
                "truncate_prompt_tokens",
            )
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "stream_options can only be set when stream is true", "stream_options"
            )
        if self.prompt_logprobs is not None and self.stream and self.prompt_logprobs != 0:
            # vLLM's rule: the prompt's logprobs come whole, not as deltas
            raise APIError(
                400, "prompt_logprobs are not available when stream is true", "prompt_logprobs"
            )
        backend = self.guided_decoding_backend
        if backend is not None and backend not in GUIDED_DECODING_BACKENDS:
            raise APIError(
                400,
                f"guided_decoding_backend {backend!r} is not one of "
                f"{', '.join(GUIDED_DECODING_BACKENDS)} (and is ignored: this engine uses "
                "llguidance)",
                "guided_decoding_backend",
            )
        self.structured_outputs_params()  # a malformed constraint is a 400 before any work
        if self.resume_token_ids is not None and self.n != 1:
            raise APIError(400, "resume_token_ids needs n=1", "resume_token_ids")
        if self.cache_salt is not None and not self.cache_salt:
            raise APIError(400, "cache_salt must be a non-empty string", "cache_salt")

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def continuous_usage(self) -> bool:
        """Usage on every chunk: vLLM's `continuous_usage_stats`, which needs `include_usage`."""
        return self.include_usage() and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's one constraint on its output, from `response_format`,
        `structured_outputs` or the older `guided_*` fields; None when it has none. Two
        constraints, from one field or several, are a 400 naming them: there is no order in
        which both could hold."""
        found = self._constraint()
        return found[0] if found is not None else None

    def constraint_field(self) -> str | None:
        """The request field the constraint came from (what a 400 about it names)."""
        found = self._constraint()
        return found[1] if found is not None else None

    def _constraint(self) -> tuple[StructuredOutputsParams, str] | None:
        found: list[tuple[str, dict[str, Any]]] = []
        whitespace = self.guided_whitespace_pattern
        options: dict[str, Any] = {}
        closed = False
        rf = self.response_format
        if rf is not None and rf.type != "text":
            found.append(("response_format", _from_response_format(rf)))
        so = self.structured_outputs
        if so is not None:
            whitespace = so.whitespace_pattern or whitespace
            if so.disable_any_whitespace:
                options["whitespace_flexible"] = False
            closed = so.disable_additional_properties
            kinds = {
                "json": so.json_,
                "regex": so.regex,
                "choice": so.choice,
                "grammar": so.grammar,
                "json_object": True if so.json_object else None,
                "structural_tag": so.structural_tag,
            }
            found += [("structured_outputs", {k: v}) for k, v in kinds.items() if v is not None]
        legacy = {
            "guided_json": ("json", self.guided_json),
            "guided_regex": ("regex", self.guided_regex),
            "guided_choice": ("choice", self.guided_choice),
            "guided_grammar": ("grammar", self.guided_grammar),
            "structural_tag": ("structural_tag", self.structural_tag),
        }
        found += [(name, {k: v}) for name, (k, v) in legacy.items() if v is not None]
        if not found:
            return None
        if len(found) > 1:
            names = ", ".join(f"{name}.{next(iter(kind))}" if name == "structured_outputs"
                              else name for name, kind in found)  # fmt: skip
            raise APIError(
                400,
                f"only one structured output constraint may be set; this request sets {names}",
                found[1][0],
            )
        param, kind = found[0]
        if "json" in kind:
            if whitespace is not None:
                options["whitespace_pattern"] = whitespace
            kind["json"] = _schema_text(kind["json"], param, options, closed)
        try:
            return StructuredOutputsParams(**kind), param
        except ValueError as e:
            raise APIError(400, str(e), param) from None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def _sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> SamplingParams:
        """For what the request leaves out, the server's `defaults` (the model's generation
        config), else vLLM's; range errors become 400s.

        Bad words stay unset (their ids need the tokenizer: `constraints.bad_words_token_ids`)
        and no token id is checked against the vocabulary here (`constraints.check_token_ids`).
        """
        neutral: dict[str, float] = {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
        }
        server = defaults or {}
        values = {
            k: server.get(k, d) if getattr(self, k) is None else getattr(self, k)
            for k, d in neutral.items()
        }
        constraint = self.structured_outputs_params()
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
                include_stop_str_in_output=self.include_stop_str_in_output,
                prompt_logprobs=prompt_logprobs,
                logit_bias=_logit_bias(self.logit_bias),
                allowed_token_ids=self.allowed_token_ids,
                structured_outputs=constraint,
                **values,
            )
        except ValueError as e:
            raise APIError.from_value_error(e) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's map of token ids (as strings) to biases, as ints; each bias clamped to
    [-100, 100], as vLLM's `SamplingParams.from_optional` clamps it."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0 or str(token) != key.strip():
            raise APIError(
                400,
                f"logit_bias key {key!r} is not a token id (a non-negative integer, as a string)",
                "logit_bias",
            )
        out[token] = min(100.0, max(-100.0, float(value)))
    return out


def _from_response_format(rf: ResponseFormat) -> dict[str, Any]:
    """The constraint kind a non-text `response_format` asks for (vLLM's mapping)."""
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise APIError(
                400,
                "response_format of type json_schema needs json_schema.schema",
                "response_format",
            )
        return {"json": rf.json_schema.json_schema}
    # structural_tag: the whole object, as vLLM passes it on
    return {"structural_tag": json.dumps(rf.model_dump(by_alias=True, exclude_none=True))}


def _schema_text(
    schema: str | dict[str, Any], param: str, options: dict[str, Any], closed: bool
) -> str:
    """A JSON schema as the JSON text `StructuredOutputsParams.json` holds. The request's
    whitespace options (vLLM's `whitespace_pattern`, `disable_any_whitespace`) go in as
    llguidance's `x-guidance` options, which win over the engine's defaults; `closed` is
    vLLM's `disable_additional_properties`."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise APIError(400, f"{param}: the schema is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise APIError(400, f"{param}: a JSON schema must be an object", param)
    if closed:
        schema = strict_json_schema(schema)
    if options:
        own = schema.get("x-guidance")
        schema = {**schema, "x-guidance": {**(own if isinstance(own, dict) else {}), **options}}
    return json.dumps(schema)


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
        if self.resume_token_ids is not None and len(self.prompts()) != 1:
            raise APIError(400, "resume_token_ids needs a single prompt", "resume_token_ids")

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

    def echo_only(self) -> bool:
        """`echo` with `max_tokens=0`: the prompt (and its logprobs) is the whole answer."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(
        self, max_tokens: int, defaults: Mapping[str, Any] | None = None
    ) -> SamplingParams:
        # vLLM's: echo asks for the prompt's logprobs as `logprobs` asks for the output's, and
        # echo without generation still runs one step (its token is discarded), since the
        # prompt's logprobs come from the step that computes it.
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        max_tokens = 1 if self.echo_only() else max_tokens
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs, defaults)


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
    parallel_tool_calls: bool | None = True  # False: the first call only (vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: documents a retrieval-augmented template renders (each a dict, often with
    # "title" and "text")
    documents: list[dict[str, str]] | None = None
    echo: bool = False  # vLLM's: see `echoed_text`
    include_reasoning: bool = True  # vLLM's: false leaves a reasoning parser's reasoning out
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        self._check_common()
        self._check_tools()
        check_continuation(self)
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

    def response_role(self) -> str:
        """The answer's role, as vLLM gives it: the assistant's after a generation prompt; else
        the last message's (the answer goes on as that message's author)."""
        return "assistant" if generation_prompt(self) else self.messages[-1].role

    def echoed_text(self) -> str:
        """With vLLM's chat `echo`, the text the answer starts with: the last message's, when
        that message is the answer's own role (with no generation prompt, the answer goes on
        as its author: a continued message); else none."""
        if not self.echo:
            return ""
        last = self.messages[-1]
        if last.role != self.response_role():
            return ""
        return str(last.to_template()["content"])  # parts joined as the template sees them

    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def to_sampling_params(
        self, max_tokens: int, defaults: Mapping[str, Any] | None = None
    ) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._sampling_params(max_tokens, logprobs, self.prompt_logprobs, defaults)
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
    continue_final_message: bool = False
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        check_continuation(self)


def check_continuation(req: ChatCompletionRequest | TokenizeRequest) -> None:
    """`continue_final_message` goes on with the last message rather than opening a new one,
    so the generation prompt (on by default) is off with it; asking for both is a 400, with
    vLLM's words."""
    if (
        req.continue_final_message
        and req.add_generation_prompt
        and "add_generation_prompt" in req.model_fields_set
    ):
        raise APIError(
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )


def generation_prompt(req: ChatCompletionRequest | TokenizeRequest) -> bool:
    """Whether the chat template adds the opening of the assistant's answer."""
    return req.add_generation_prompt and not req.continue_final_message


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
    """How many tokens to generate: what was asked, else `default`, else all that fit, and
    never past the room the prompt leaves (an ask past it is cut to it, as vLLM does).

    A prompt that leaves no room, or an ask past the whole context, is a 400 naming the limit.
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
    if requested > max_model_len:
        raise APIError(
            400,
            f"'{param}' is too large: {requested}. It cannot be greater than this model's "
            f"maximum context length, {max_model_len} tokens. Please request fewer output "
            "tokens.",
            param,
        )
    return min(requested, room)
