"""The request surface of structured outputs and logits masks at the API edge, without an engine:
request → `SamplingParams` (response_format, structured_outputs, guided_*, logit_bias,
allowed_token_ids, bad_words, prompt logprobs, echo), the 400s, the response shaping of prompt
logprobs and usage, and the routes over the scripted fake engine of test_protocol."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from baton.engine.api import constraints
from baton.engine.api import protocol as p
from baton.engine.api import responses as r
from baton.engine.outputs import CompletionOutput, Logprob, RequestOutput
from baton.engine.sampling_params import SamplingParams, StructuredOutputsParams
from baton.errors import APIError
from tests.engine.api.test_protocol import SCRIPT, FakeLLM, _app, _call, _error, _events

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name"],
}
MESSAGES = [{"role": "user", "content": "hi"}]


def _completion(**kw: Any) -> p.CompletionRequest:
    return p.CompletionRequest(prompt="x", **kw)


def _chat(**kw: Any) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest(messages=MESSAGES, **kw)  # type: ignore[arg-type]


def _constraint(**kw: Any) -> StructuredOutputsParams | None:
    """The constraint, the same on completions and chat (vLLM accepts every shape on both)."""
    ours = _completion(**kw).structured_outputs_params()
    assert _chat(**kw).structured_outputs_params() == ours
    return ours


def _bad(field: str, **kw: Any) -> str:
    with pytest.raises(APIError) as e:
        _completion(**kw).check()
    assert e.value.status == 400 and e.value.param == field, e.value.message
    return e.value.message


# ---- structured outputs: the shapes --------------------------------------------------------


def test_response_format_maps_to_one_constraint() -> None:
    """OpenAI's json_schema (its `schema`, with `strict`), json_object and text; vLLM's
    structural_tag passes the whole object on as JSON."""
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    got = _constraint(response_format=rf)
    assert got is not None and json.loads(got.json or "") == SCHEMA
    assert _constraint(response_format={"type": "json_object"}) == StructuredOutputsParams(
        json_object=True
    )
    assert _constraint(response_format={"type": "text"}) is None
    assert _constraint() is None
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
        "triggers": ["<f>"],
    }
    got = _constraint(response_format=tag)
    assert got is not None and json.loads(got.structural_tag or "") == tag


def test_structured_outputs_and_guided_fields_map_to_one_constraint() -> None:
    """vLLM's `structured_outputs` object and its older `guided_*` names give the same params."""
    so = StructuredOutputsParams
    assert _constraint(structured_outputs={"json": SCHEMA}).json == json.dumps(SCHEMA)  # type: ignore[union-attr]
    assert _constraint(structured_outputs={"json": json.dumps(SCHEMA)}).json == json.dumps(SCHEMA)  # type: ignore[union-attr]
    assert _constraint(guided_json=SCHEMA).json == json.dumps(SCHEMA)  # type: ignore[union-attr]
    assert _constraint(structured_outputs={"regex": "[a-z]+"}) == so(regex="[a-z]+")
    assert _constraint(guided_regex="[a-z]+") == so(regex="[a-z]+")
    assert _constraint(structured_outputs={"choice": ["yes", "no"]}) == so(choice=("yes", "no"))
    assert _constraint(guided_choice=["yes", "no"]) == so(choice=("yes", "no"))
    assert _constraint(structured_outputs={"grammar": 'root ::= "a"'}) == so(grammar='root ::= "a"')
    assert _constraint(guided_grammar='root ::= "a"') == so(grammar='root ::= "a"')
    assert _constraint(structured_outputs={"json_object": True}) == so(json_object=True)
    assert _constraint(structural_tag='{"type": "x"}') == so(structural_tag='{"type": "x"}')
    # Options this engine has no use for are accepted.
    assert _constraint(structured_outputs={"regex": "a", "disable_fallback": True}) == so(regex="a")


def test_constraint_reaches_sampling_params() -> None:
    params = _completion(guided_regex="[0-9]{3}").to_sampling_params(8)
    assert params.structured_outputs == StructuredOutputsParams(regex="[0-9]{3}")
    chat = _chat(response_format={"type": "json_object"}).to_sampling_params(8)
    assert chat.structured_outputs == StructuredOutputsParams(json_object=True)


def test_whitespace_pattern_goes_into_the_schema() -> None:
    """vLLM's whitespace pattern, as llguidance's `x-guidance` option of the schema."""
    got = _constraint(guided_json=SCHEMA, guided_whitespace_pattern=r"[ ]?")
    assert got is not None and json.loads(got.json or "")["x-guidance"] == {
        "whitespace_pattern": r"[ ]?"
    }
    got = _constraint(structured_outputs={"json": SCHEMA, "whitespace_pattern": " "})
    assert got is not None and json.loads(got.json or "")["properties"] == SCHEMA["properties"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "guided_grammar": "x"}, "guided_grammar"),
    ],
)
def test_two_constraints_are_a_400(fields: dict[str, Any], param: str) -> None:
    """No order makes two constraints hold at once: a 400 naming both, never a silent pick."""
    message = _bad(param, **fields)
    assert "only one structured output constraint" in message


def test_malformed_constraints_are_400s_naming_the_field() -> None:
    assert "not valid JSON" in _bad("guided_json", guided_json="{not json")
    assert "object" in _bad("structured_outputs", structured_outputs={"json": "[1, 2]"})
    assert "schema" in _bad(
        "response_format", response_format={"type": "json_schema", "json_schema": {"name": "x"}}
    )
    _bad("guided_choice", guided_choice=[])
    _bad("structured_outputs", structured_outputs={"choice": []})


def test_guided_decoding_backend_is_ignored_unless_unknown() -> None:
    """vLLM deprecated the per-request backend and ignores it; a name no backend has is a 400."""
    for name in ("xgrammar", "guidance", "outlines", "auto"):
        _completion(guided_regex="a", guided_decoding_backend=name).check()
    assert "bogus" in _bad("guided_decoding_backend", guided_decoding_backend="bogus")


# ---- logits masks ----------------------------------------------------------------------------


def test_logit_bias_keys_become_ids_and_values_are_clamped() -> None:
    """OpenAI's string keys; values clamped to [-100, 100] as vLLM's from_optional does."""
    params = _completion(logit_bias={"5": 3.5, "7": -250, "9": 1e9}).to_sampling_params(4)
    assert params.logit_bias == {5: 3.5, 7: -100.0, 9: 100.0}
    assert _completion().to_sampling_params(4).logit_bias is None
    for key in ("abc", "-1", "1.5", ""):
        with pytest.raises(APIError) as e:
            _completion(logit_bias={key: 1}).to_sampling_params(4)
        assert e.value.param == "logit_bias"


def test_token_ids_are_checked_against_the_vocabulary() -> None:
    """vLLM's processor checks: out-of-vocab ids in logit_bias, allowed_token_ids, bad words."""
    ok = SamplingParams(logit_bias={9: 1.0}, allowed_token_ids=[0, 9], bad_words_token_ids=[[9]])
    constraints.check_token_ids(ok, vocab_size=10)
    cases = [
        (SamplingParams(logit_bias={10: 1.0}), "logit_bias"),
        (SamplingParams(allowed_token_ids=[3, 12]), "allowed_token_ids"),
        (SamplingParams(bad_words_token_ids=[[1, 10]]), "bad_words"),
    ]
    for params, field in cases:
        with pytest.raises(APIError) as e:
            constraints.check_token_ids(params, vocab_size=10)
        assert e.value.param == field and "10" in e.value.message
    with pytest.raises(APIError) as e:
        _completion(allowed_token_ids=[]).to_sampling_params(4)
    assert e.value.param == "allowed_token_ids"


def test_bad_words_are_tokenized_as_vllm_does() -> None:
    """The word alone, and after a space where that makes a word-start token of the same
    length (vLLM's update_from_tokenizer); otherwise the spaced form adds nothing."""
    vocab = {"hello": [5], " hello": [6], "big dog": [1, 2], " big dog": [3, 2], "ab": [7, 8],
             " ab": [9, 7, 8]}  # fmt: skip
    words = constraints.bad_words_token_ids(["hello", " big dog", "ab"], vocab.__getitem__)
    assert words == [[5], [6], [1, 2], [3, 2], [7, 8]]
    with pytest.raises(APIError) as e:
        constraints.bad_words_token_ids([" "], lambda _: [])
    assert e.value.param == "bad_words"


def test_include_stop_str_in_output_passes_through() -> None:
    assert (
        _completion(include_stop_str_in_output=True)
        .to_sampling_params(4)
        .include_stop_str_in_output
    )
    assert not _chat().to_sampling_params(4).include_stop_str_in_output


# ---- prompt logprobs and echo --------------------------------------------------------------


def test_echo_asks_for_prompt_logprobs() -> None:
    """vLLM: echo sets prompt_logprobs to logprobs unless given; echo with max_tokens=0 runs one
    step (discarded) since the prompt's logprobs come from the step that computes it."""
    assert _completion(echo=True, logprobs=3).to_sampling_params(8).prompt_logprobs == 3
    assert (
        _completion(echo=True, logprobs=3, prompt_logprobs=1).to_sampling_params(8).prompt_logprobs
        == 1
    )
    assert _completion(logprobs=3).to_sampling_params(8).prompt_logprobs is None
    assert _completion(echo=True).to_sampling_params(8).prompt_logprobs is None
    echo_only = _completion(echo=True, logprobs=1, max_tokens=0)
    assert echo_only.echo_only() and echo_only.to_sampling_params(0).max_tokens == 1
    assert _chat(prompt_logprobs=2).to_sampling_params(4).prompt_logprobs == 2
    assert "stream" in _bad("prompt_logprobs", prompt_logprobs=1, stream=True)
    with pytest.raises(APIError) as e:
        _completion(prompt_logprobs=21).to_sampling_params(4)  # vLLM's max_logprobs bound, 20
    assert e.value.param == "prompt_logprobs"
    _completion(prompt_logprobs=0, stream=True).check()


def _out(prompt_ids: list[int], sample_ids: list[int], **kw: Any) -> RequestOutput:
    sample = CompletionOutput(
        0, "".join(chr(t) for t in sample_ids), sample_ids,
        logprobs=[{t: Logprob(-0.5, 1)} for t in sample_ids], finish_reason="length",
    )  # fmt: skip
    return RequestOutput("r", "".join(chr(t) for t in prompt_ids), prompt_ids, [sample], **kw)


PROMPT_LOGPROBS = [None, {98: Logprob(-1.5, 2), 120: Logprob(-0.1, 1)}, {99: Logprob(-math.inf, 9)}]


def test_echo_logprobs_carry_the_prompts() -> None:
    """Echo with logprobs: the prompt's own logprobs lead (None for the first token), then the
    output's; `prompt_logprobs` in the choice as vLLM's (ids as keys, -inf clamped)."""
    out = _out([97, 98, 99], [100], prompt_logprobs=PROMPT_LOGPROBS)
    req = _completion(echo=True, logprobs=1, max_tokens=1)
    choice = r.completion_response(req, "id", 0, "m", [out], chr).model_dump(mode="json")[
        "choices"
    ][0]
    assert choice["text"] == "abcd"
    assert choice["logprobs"]["tokens"] == ["a", "b", "c", "d"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.5, -9999.0, -0.5]
    assert choice["logprobs"]["top_logprobs"][1] == {"x": -0.1, "b": -1.5}
    assert choice["prompt_logprobs"][0] is None
    assert choice["prompt_logprobs"][1]["98"] == {"logprob": -1.5, "rank": 2, "decoded_token": "b"}
    assert choice["prompt_logprobs"][2]["99"]["logprob"] == -9999.0


def test_echo_without_generation_returns_the_prompt_only() -> None:
    """echo, max_tokens=0: text, tokens and logprobs are the prompt's (the step's token is
    dropped), as vLLM's serving_completion shapes it."""
    out = _out([97, 98, 99], [100], prompt_logprobs=PROMPT_LOGPROBS)
    req = _completion(echo=True, logprobs=0, max_tokens=0)
    choice = r.completion_response(req, "id", 0, "m", [out], chr).model_dump(mode="json")[
        "choices"
    ][0]
    assert choice["text"] == "abc" and choice["logprobs"]["tokens"] == ["a", "b", "c"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.5, -9999.0]


def test_usage_counts_cached_prompt_tokens() -> None:
    """prompt_tokens_details.cached_tokens from the prefix cache, summed over the prompts; off,
    no details (vLLM's --enable-prompt-tokens-details)."""
    outs = [_out([1, 2, 3], [4], num_cached_tokens=2), _out([5, 6], [7], num_cached_tokens=1)]
    usage = r.usage_of(outs)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (5, 2, 7)
    assert (
        usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 3
    )
    assert r.usage_of(outs, prompt_tokens_details=False).prompt_tokens_details is None


def test_chat_response_carries_prompt_logprobs() -> None:
    out = _out([97, 98, 99], [100], prompt_logprobs=PROMPT_LOGPROBS)
    body = r.chat_response(_chat(prompt_logprobs=1), "id", 0, "m", out, chr).model_dump(mode="json")
    assert body["prompt_logprobs"][1]["120"]["logprob"] == -0.1
    assert r.chat_response(_chat(), "id", 0, "m", _out([97], [98]), chr).prompt_logprobs is None


# ---- the routes, over the scripted fake engine ------------------------------------------------


class FakeValidator:
    """The grammar compiler's edge check, refusing one marker schema."""

    def __init__(self) -> None:
        self.seen: list[StructuredOutputsParams] = []

    def validate(self, params: StructuredOutputsParams) -> None:
        self.seen.append(params)
        if params.json is not None and "bogus" in params.json:
            raise ValueError("unknown type 'bogus' at /properties/x")


def _checked_app(**config: Any) -> tuple[Any, FakeLLM, FakeValidator]:
    llm, validator = FakeLLM(), FakeValidator()
    app = _app(llm, **config)
    app.state.server._validator = validator
    return app, llm, validator


def test_a_schema_the_compiler_refuses_is_a_400_and_the_server_goes_on() -> None:
    app, llm, validator = _checked_app()
    bad = {"type": "object", "properties": {"x": {"type": "bogus"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}
    for route, body in [
        ("/v1/chat/completions", {"messages": MESSAGES, "response_format": rf}),
        ("/v1/completions", {"prompt": "x", "guided_json": bad}),
    ]:
        resp = _call(app, "POST", route, json=body)
        message = _error(resp, 400, "response_format" if "messages" in body else "guided_json")
        assert "bogus" in message
    assert llm.seen == []  # nothing reached the engine
    rf["json_schema"]["schema"] = SCHEMA  # type: ignore[index]
    body = {"messages": MESSAGES, "response_format": rf, "max_tokens": 3}
    resp = _call(app, "POST", "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert llm.seen[-1][2].structured_outputs == StructuredOutputsParams(json=json.dumps(SCHEMA))
    assert validator.seen[-1] == llm.seen[-1][2].structured_outputs


def test_routes_check_ids_and_tokenize_bad_words() -> None:
    app, llm, _ = _checked_app()
    resp = _call(app, "POST", "/v1/completions", json={"prompt": "x", "logit_bias": {"512": 5}})
    assert "out-of-vocab" in _error(resp, 400, "logit_bias")
    resp = _call(app, "POST", "/v1/completions", json={"prompt": "x", "allowed_token_ids": [600]})
    _error(resp, 400, "allowed_token_ids")
    resp = _call(
        app, "POST", "/v1/completions", json={"prompt": "x", "response_format": {"type": "xml"}}
    )
    _error(resp, 400, "response_format")
    body = {"prompt": ["a", "b"], "max_tokens": 2, "bad_words": ["hi"], "logit_bias": {"104": -100}}
    resp = _call(app, "POST", "/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    # The char tokenizer: "hi" is two tokens, " hi" three, so only the bare form is banned.
    assert [s.bad_words_token_ids for _, _, s in llm.seen] == [[[104, 105]], [[104, 105]]]
    assert llm.seen[0][2].logit_bias == {104: -100.0}


def test_continuous_usage_on_every_chunk() -> None:
    """vLLM's continuous_usage_stats: each chunk's usage is its prompt and its sample so far;
    the last chunk the whole usage, with cached tokens."""
    app, _, _ = _checked_app()
    options = {"include_usage": True, "continuous_usage_stats": True}
    for route, body in [
        ("/v1/completions", {"prompt": "ab"}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ]:
        body = {**body, "max_tokens": 3, "stream": True, "stream_options": options}
        events = _events(_call(app, "POST", route, json=body))
        chunks, last = events[:-1], events[-1]
        assert all(c["usage"] is not None for c in chunks)
        completed = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
        assert completed == sorted(completed) and completed[-1] == 3
        prompt_tokens = chunks[0]["usage"]["prompt_tokens"]
        assert last["choices"] == [] and last["usage"] == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 3,
            "total_tokens": prompt_tokens + 3,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
    # Without include_usage it asks for nothing.
    body = {"prompt": "ab", "max_tokens": 2, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}  # fmt: skip
    assert all("usage" not in c for c in _events(_call(app, "POST", "/v1/completions", json=body)))


def test_prompt_tokens_details_can_be_turned_off() -> None:
    app, _, _ = _checked_app(enable_prompt_tokens_details=False)
    body = {"prompt": "ab", "max_tokens": 2}
    assert _call(app, "POST", "/v1/completions", json=body).json()["usage"] == {
        "prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
        "prompt_tokens_details": None,
    }  # fmt: skip


def test_echo_without_generation_over_the_route() -> None:
    """echo + max_tokens=0, whole and streamed: the prompt is the answer."""
    app, llm, _ = _checked_app()
    body: dict[str, Any] = {"prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 1}
    choice = _call(app, "POST", "/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == "abc" and len(choice["logprobs"]["tokens"]) == 3
    assert llm.seen[-1][2].max_tokens == 1 and llm.seen[-1][2].prompt_logprobs == 1
    events = _events(_call(app, "POST", "/v1/completions", json={**body, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "abc"
    assert SCRIPT[0] not in "abc"  # the discarded token would have shown


def test_the_grammar_compilers_errors_name_the_request_field(tiny_model: Any) -> None:
    """With the real compiler (llguidance over the tiny model's tokenizer): each problem is a
    400 naming the field the client wrote, not the engine's name for it."""
    from baton.engine.structured.backend import GrammarCompiler
    from baton.tokenizer import load_tokenizer

    compiler = GrammarCompiler(load_tokenizer(tiny_model("llama")), 512, [2])
    bad = {"type": "object", "properties": {"x": {"type": "bogus"}}}
    cases = [
        ({"guided_json": bad}, "guided_json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": bad}}},
         "response_format"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs"),
    ]  # fmt: skip
    for fields, param in cases:
        req = _completion(**fields)
        constraint = req.structured_outputs_params()
        assert constraint is not None
        with pytest.raises(APIError) as e:
            constraints.validate_constraint(compiler, constraint, param)
        assert e.value.param == param and e.value.message.startswith(param), e.value.message
        assert "structured_outputs." not in e.value.message or param == "structured_outputs"
    constraints.validate_constraint(compiler, StructuredOutputsParams(json=json.dumps(SCHEMA)), "x")


def test_per_request_whitespace_and_closed_objects() -> None:
    """vLLM's per-request `disable_any_whitespace` and `disable_additional_properties` reach the
    grammar: compact JSON for this request, objects that allow no other properties."""
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    got = _constraint(
        structured_outputs={
            "json": open_schema,
            "disable_any_whitespace": True,
            "disable_additional_properties": True,
        }
    )
    assert got is not None
    schema = json.loads(got.json or "")
    assert schema["x-guidance"] == {"whitespace_flexible": False}
    assert schema["additionalProperties"] is False
    plain = _constraint(structured_outputs={"json": open_schema})
    assert plain is not None and json.loads(plain.json or "") == open_schema


def test_a_tokenizer_the_grammar_library_cannot_read_is_a_400_not_a_500() -> None:
    """The fake engine's character tokenizer (a Fuse decoder) is one llguidance refuses: every
    constrained request is a 400 that says so, and unconstrained ones are served."""
    llm = FakeLLM()
    app = _app(llm)
    for _ in range(2):  # the failure is remembered, not retried per request
        resp = _call(app, "POST", "/v1/completions", json={"prompt": "x", "guided_regex": "a+"})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert "cannot read its tokenizer" in error["message"] and error["param"] == "guided_regex"
    assert _call(app, "POST", "/v1/completions", json={"prompt": "x"}).status_code == 200
