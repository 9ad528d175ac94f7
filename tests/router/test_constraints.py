"""Structured outputs and the sampling surface through the router: every field reaches the engine
unchanged; a disaggregated request's prefill step drops what only constrains sampling and keeps
what shapes the prompt; a request that wants prompt logprobs goes to one engine whole."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from baton.router.handoff import CONSTRAINT_FIELDS, prefill_body, wants_prompt_logprobs
from tests.router.harness import FakeCluster, routed

LONG = "The relay team passes the baton in a marked zone. " * 8  # over disagg_min_tokens
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CONSTRAINTS: dict[str, Any] = {
    "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
    "structured_outputs": {"regex": "[0-9]+"},
    "guided_json": SCHEMA,
    "guided_regex": "[a-z]+",
    "guided_choice": ["yes", "no"],
    "guided_grammar": 'root ::= "a"',
    "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ",
    "structural_tag": "{}",
    "logit_bias": {"5": 10},
    "allowed_token_ids": [1, 2, 3],
    "bad_words": ["bad"],
}
# What shapes the prompt or the rest of the answer: kept in step 1 or passed on as it is.
KEPT: dict[str, Any] = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}],
    "tool_choice": "none",
    "chat_template_kwargs": {"enable_thinking": False},
    "include_stop_str_in_output": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
}


def test_the_prefill_body_drops_only_the_constraints() -> None:
    chat = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 9, **CONSTRAINTS,
            **KEPT}  # fmt: skip
    step1 = prefill_body("/v1/chat/completions", chat)
    assert not set(CONSTRAINTS) & set(step1)
    assert set(CONSTRAINTS) == set(CONSTRAINT_FIELDS)
    assert step1["messages"] == chat["messages"] and step1["tools"] == KEPT["tools"]
    assert step1["chat_template_kwargs"] == KEPT["chat_template_kwargs"]
    assert step1["tool_choice"] == "none"
    assert all(k in chat for k in CONSTRAINTS)  # the original is left as it was
    # A forced call or "auto" is the decode engine's business: step 1 compiles no tool grammar
    # and needs no tool parser, and the tools still render into the same prompt.
    for choice in ("required", "auto", {"type": "function", "function": {"name": "f"}}):
        step1 = prefill_body("/v1/chat/completions", {**chat, "tool_choice": choice})
        assert step1["tool_choice"] == "none" and step1["tools"] == KEPT["tools"]


def test_which_requests_want_prompt_logprobs() -> None:
    """vLLM's prompt_logprobs (0 too: the prompt token's own logprob), and completions' echo
    with logprobs, which implies it."""
    assert wants_prompt_logprobs("/v1/completions", {"prompt_logprobs": 0})
    assert wants_prompt_logprobs("/v1/chat/completions", {"prompt_logprobs": 2})
    assert wants_prompt_logprobs("/v1/completions", {"echo": True, "logprobs": 0})
    assert not wants_prompt_logprobs("/v1/completions", {"echo": True})
    assert not wants_prompt_logprobs("/v1/completions", {"logprobs": 3})
    assert not wants_prompt_logprobs("/v1/completions", {"prompt_logprobs": None})


def _post(url: str, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body, timeout=10)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_fields_pass_through_to_an_aggregated_engine(cluster: FakeCluster, route: str) -> None:
    engine, _ = cluster.add("both")
    prompt: dict[str, Any] = (
        {"prompt": LONG} if route == "/v1/completions" else {"messages": [{"role": "user",
                                                                         "content": LONG}]}
    )  # fmt: skip
    extra = (
        {"prompt_logprobs": 1, "echo": True, "logprobs": 2} if route == "/v1/completions" else {}
    )
    body = {"model": "fake", "max_tokens": 3, "stream": True, **prompt, **CONSTRAINTS, **KEPT,
            **extra}  # fmt: skip
    with routed(cluster) as router:
        assert _post(router.url, route, body).status_code == 200
    # a stream's engine is also asked for token ids: the router's record for a migration
    assert engine.requests == [{**body, "return_token_ids": True}]


def test_a_disaggregated_request_constrains_only_on_the_decode_engine(
    cluster: FakeCluster,
) -> None:
    prefill, _ = cluster.add("prefill")
    decode, _ = cluster.add("decode")
    body = {"model": "fake", "messages": [{"role": "user", "content": LONG}], "max_tokens": 4,
            **CONSTRAINTS, **KEPT, "stream": True}  # fmt: skip
    with routed(cluster) as router:
        assert _post(router.url, "/v1/chat/completions", body).status_code == 200
        assert prefill.prefills == 1 and decode.remote_decodes == 1
        (step1,) = prefill.requests
        assert not set(CONSTRAINTS) & set(step1)
        assert step1["tools"] == KEPT["tools"] and step1["messages"] == body["messages"]
        (step2,) = decode.requests
        assert {k: step2[k] for k in body} == body  # the original, less nothing
        assert step2["kv_transfer_params"]["do_remote_prefill"] is True
        name = "baton:router_disagg_decisions_total"
        assert router.metric(name, outcome="disaggregated") == 1


@pytest.mark.parametrize(
    "extra", [{"prompt_logprobs": 1}, {"echo": True, "logprobs": 1, "max_tokens": 0}]
)
def test_prompt_logprobs_are_served_whole_on_one_engine(
    cluster: FakeCluster, extra: dict[str, Any]
) -> None:
    """Only the engine that computes the prompt has its logits: no hand-off, counted."""
    prefill, _ = cluster.add("prefill")
    decode, _ = cluster.add("decode")
    body = {"model": "fake", "prompt": LONG, "max_tokens": 2, **extra}
    with routed(cluster) as router:
        assert _post(router.url, "/v1/completions", body).status_code == 200
        assert prefill.requests == []
        assert decode.requests == [body] and decode.remote_decodes == 0
        name = "baton:router_disagg_decisions_total"
        assert router.metric(name, outcome="decode_only_fallback") == 1
        assert router.metric(name, outcome="disaggregated") == 0
