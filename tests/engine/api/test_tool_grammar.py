"""The grammars of forced tool choices, run through llguidance (the engine's grammar library)
with a sampler that picks any token the grammar allows, as a random model would: whatever it
picks, the answer parses into calls whose arguments validate against their tools' schemas.
This checks the schema the chat route builds and the parser that reads the answer, without an
engine."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import llguidance.numpy as lnp
import numpy as np
import pytest

from baton.engine.api.protocol import ChatCompletionRequest
from baton.engine.api.tool_parsers import NamedToolParser, RequiredToolParser, ToolParser
from baton.engine.api.tools import ChoiceParser, OutputMode, forced_tool_schema
from baton.engine.models.tiny import EOS_TOKEN_ID
from baton.tokenizer import load_tokenizer
from tests.engine.api.test_tools_server import SCHEMAS, TOOLS


def _sample(model: Path, schema: dict[str, Any], seed: int, budget: int = 600) -> str:
    tokenizer = llguidance.LLTokenizer(
        (model / "tokenizer.json").read_text(), eos_token=EOS_TOKEN_ID
    )
    matcher = llguidance.LLMatcher(
        tokenizer, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    )
    mask = lnp.allocate_token_bitmask(1, tokenizer.vocab_size)
    rng = random.Random(seed)
    out: list[int] = []
    for _ in range(budget):
        lnp.fill_next_token_bitmask(matcher, mask, 0)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: tokenizer.vocab_size]
        token = int(rng.choice(np.flatnonzero(bits).tolist()))
        if token == EOS_TOKEN_ID:
            return load_tokenizer(model).decode(out)
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    pytest.fail(f"no end after {budget} tokens")


def _calls(parser: ToolParser, text: str) -> list[tuple[str, Any]]:
    message = ChoiceParser(OutputMode(parser, True, None, "closed")).message(text)
    assert message.content is None
    calls = [(c.name, json.loads(c.arguments)) for _, c in message.calls]
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    return calls


@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_gives_valid_calls(model: Path, parallel: bool) -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": parallel,
        }
    )
    schema = forced_tool_schema(req)
    assert schema is not None
    for seed in range(6):
        calls = _calls(RequiredToolParser(), _sample(model, schema, seed))
        assert calls and (parallel or len(calls) == 1)


def test_named_always_gives_valid_arguments(model: Path) -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }
    )
    schema = forced_tool_schema(req)
    assert schema is not None
    for seed in range(6):
        text = _sample(model, schema, seed)
        assert [n for n, _ in _calls(NamedToolParser("get_weather"), text)] == ["get_weather"]
