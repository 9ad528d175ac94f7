"""Structured outputs and the sampling surface against the real engine server (the shared
`server` fixture: random tiny weights, so an unconstrained answer is noise and only the grammar
can make one valid), driven by the `openai` client.

"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from tests.support.engine_server import NAME, Server, expect_error
from tests.support.json_schemas import CLOSED_SCHEMAS

pytestmark = pytest.mark.slow  # the shared server process


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["color", "ok", "tags"],
    "additionalProperties": False,
}


def _post(server: Server, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json={"model": NAME, **body}, timeout=60)


def test_bad_constraints_are_400s_and_the_engine_keeps_serving(server: Server) -> None:
    """What the grammar library rejects is a 400 naming the field, before the core sees it."""
    bad_schema = {"type": "object", "properties": {"x": {"type": "bogus"}}}
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema":
         {"name": "x", "schema": bad_schema}}}, "response_format"),
        ("/v1/completions", {"guided_regex": "[a-"}, "guided_regex"),
        ("/v1/completions", {"structured_outputs": {"grammar": "root ::= missing"}},
         "structured_outputs"),
        ("/v1/completions", {"guided_json": bad_schema, "guided_choice": ["a"]}, "guided_choice"),
        ("/v1/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),
        ("/v1/completions", {"allowed_token_ids": [100000]}, "allowed_token_ids"),
    ]  # fmt: skip
    for route, fields, param in cases:
        prompt = {"prompt": "x"} if route == "/v1/completions" else {
            "messages": [{"role": "user", "content": "x"}]}  # fmt: skip
        error = expect_error(_post(server, route, {**prompt, **fields, "max_tokens": 4}), 400)
        assert error["param"] == param, error
    ok = _post(server, "/v1/completions", {"prompt": "still serving", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_json_schema_answers_validate(server: Server) -> None:
    """response_format json_schema on chat and guided_json on completions: every answer is
    JSON that validates against the schema, several samples each."""
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    chat = {"messages": [{"role": "user", "content": "a colour"}], "response_format": rf}
    completion = {"prompt": "a colour:", "guided_json": SCHEMA}
    for route, body in [("/v1/chat/completions", chat), ("/v1/completions", completion)]:
        resp = _post(server, route, {**body, "n": 3, "seed": 1, "max_tokens": 200})
        assert resp.status_code == 200, resp.text
        for choice in resp.json()["choices"]:
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            assert choice["finish_reason"] == "stop", text
            jsonschema.validate(json.loads(text), SCHEMA)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=CLOSED_SCHEMAS, seed=st.integers(0, 2**16))
def test_random_schemas_answers_validate(server: Server, schema: dict[str, Any], seed: int) -> None:
    """Property-based: random nested schemas (objects closed, so every answer can end), sent as
    OpenAI's response_format through the `openai` client to the random tiny model, whose free
    output is noise: every answer ends and validates."""
    client = server.client()
    rf: Any = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    completion = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "json"}], response_format=rf,
        max_tokens=400, seed=seed, n=2,
    )  # fmt: skip
    for choice in completion.choices:
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


class Pick(BaseModel):
    color: Literal["red", "green"]
    ok: bool


def test_openai_parse_returns_a_parsed_object(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    done = client.chat.completions.parse(
        model=NAME,
        messages=[{"role": "user", "content": "pick"}],
        response_format=Pick,
        max_tokens=100,
        seed=3,
    )
    assert isinstance(done.choices[0].message.parsed, Pick)


def test_regex_and_choice_outputs_match(server: Server) -> None:
    resp = _post(server, "/v1/completions", {"prompt": "n:", "guided_regex": "[0-9]{3}-[ab]",
                                             "max_tokens": 20, "n": 2, "seed": 2})  # fmt: skip
    for choice in resp.json()["choices"]:
        assert re.fullmatch("[0-9]{3}-[ab]", choice["text"]), choice
    options = ["alpha", "beta", "gamma"]
    body = {"messages": [{"role": "user", "content": "?"}], "max_tokens": 10,
            "structured_outputs": {"choice": options}}  # fmt: skip
    resp = _post(server, "/v1/chat/completions", body)
    assert resp.json()["choices"][0]["message"]["content"] in options


def test_echo_with_logprobs_scores_the_prompt(server: Server) -> None:
    """What evaluation harnesses send: echo, logprobs, max_tokens=0; the prompt comes back with
    a logprob for every token but the first."""
    body = {"prompt": "The relay team passed the baton", "echo": True, "logprobs": 1,
            "max_tokens": 0, "temperature": 0}  # fmt: skip
    choice = _post(server, "/v1/completions", body).json()["choices"][0]
    assert choice["text"] == body["prompt"]
    logprobs = choice["logprobs"]["token_logprobs"]
    assert logprobs[0] is None and all(isinstance(x, float) for x in logprobs[1:])
    assert len(choice["prompt_logprobs"]) == len(logprobs)
