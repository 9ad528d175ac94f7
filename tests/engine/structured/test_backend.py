"""The grammar backend: every constraint kind, walked at random through its masks on a tiny
model's tokenizer (and SmolLM2's where installed), yields text its oracle accepts (jsonschema,
re.fullmatch, membership, Python's parser); bad constraints give precise `GrammarError`s."""

from __future__ import annotations

import ast
import json
import random
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.engine.models.tiny import EOS_TOKEN_ID
from baton.engine.sampling_params import StructuredOutputsParams
from baton.engine.structured.backend import (
    Grammar,
    GrammarCompiler,
    GrammarError,
    strict_json_schema,
)
from baton.tokenizer import Tokenizer, load_tokenizer
from tests.engine.structured.walk import allowed_ids, matcher_mask, random_walk
from tests.engine.tokenizer_folders import smollm2_folder
from tests.support.json_schemas import SCHEMAS

# Wider than the tiny tokenizer's 512 tokens, as padded embeddings are: ids 512..519 are no token.
TINY_VOCAB = 520

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}

ARITH_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,3}/
"""

ARITH_GBNF = r"""
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= [1-9] [0-9]? [0-9]? | "(" expr ")"
"""


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model: Callable[..., Path]) -> Tokenizer:
    return load_tokenizer(tiny_model("llama"))


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tiny_tokenizer, TINY_VOCAB, [EOS_TOKEN_ID], any_whitespace=False)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, GrammarCompiler]:
    # The tokenizer tests' folder (the same root), converted from the GGUF file once a session.
    tok = load_tokenizer(smollm2_folder(tmp_path_factory.getbasetemp()))
    eos = tok.encode("<|im_end|>", add_special_tokens=False)
    # Without free whitespace: SmolLM2 has hundreds of whitespace tokens, which a uniform walk
    # would pick for ever.
    return tok, GrammarCompiler(tok, 49152, eos, any_whitespace=False)


def walk(
    compiler: GrammarCompiler,
    tok: Tokenizer,
    grammar: Grammar,
    seed: int,
    *,
    prefix: str = "",
    max_tokens: int = 400,
) -> str | None:
    """One random walk through `grammar` (after forcing `prefix`'s tokens); the decoded text,
    or None when it did not end within `max_tokens`."""
    m = grammar.matcher()
    forced = tok.encode(prefix, add_special_tokens=False) if prefix else []
    assert m.consume_tokens(forced), m.get_error()
    ids = random_walk(
        lambda: matcher_mask(m, compiler.vocab_size),
        m.consume_token,
        compiler.vocab_size,
        compiler.eos_token_ids,
        random.Random(seed),
        max_tokens=max_tokens,
    )
    if ids is None:
        return None
    assert not m.is_error(), m.get_error()
    return tok.decode(forced + ids)


def walks(
    compiler: GrammarCompiler,
    tok: Tokenizer,
    params: StructuredOutputsParams,
    n: int,
    **kwargs: Any,
) -> list[str]:
    """`n` random walks' texts, the ones that ended (most must)."""
    grammar = compiler.compile(params)
    texts = [walk(compiler, tok, grammar, seed, **kwargs) for seed in range(n)]
    done = [t for t in texts if t is not None]
    assert len(done) >= n // 2, f"only {len(done)} of {n} walks ended"
    return done


def test_json_schema_walks_validate(compiler: GrammarCompiler, tiny_tokenizer: Tokenizer) -> None:
    """Every random walk through a nested schema (bounds, enums, patterns, required, closed
    objects) is JSON that the schema validates."""
    for text in walks(
        compiler, tiny_tokenizer, StructuredOutputsParams(json=json.dumps(PERSON)), 12
    ):
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_walks_are_objects(
    compiler: GrammarCompiler, tiny_tokenizer: Tokenizer
) -> None:
    """json_object yields JSON objects and nothing else."""
    for text in walks(compiler, tiny_tokenizer, StructuredOutputsParams(json_object=True), 12):
        assert isinstance(json.loads(text), dict), text


def test_regex_walks_fullmatch(compiler: GrammarCompiler, tiny_tokenizer: Tokenizer) -> None:
    """A regex constrains the whole output: every walk fullmatches it."""
    pattern = r"(ab|cd)+-[0-9]{2,4}(\.[a-z]+)?"
    for text in walks(compiler, tiny_tokenizer, StructuredOutputsParams(regex=pattern), 16):
        assert re.fullmatch(pattern, text), text


def test_choice_walks_pick_one(compiler: GrammarCompiler, tiny_tokenizer: Tokenizer) -> None:
    """A choice yields exactly one of its strings; quotes, backslashes, newlines, regex and
    Lark metacharacters and non-ASCII text in a choice are literal."""
    choices = ("yes", "no", 'say "hi"', "back\\slash", "two\nlines", "a|b*", "/x/", "café ✓")
    texts = walks(compiler, tiny_tokenizer, StructuredOutputsParams(choice=choices), 40)
    assert set(texts) <= set(choices)
    assert len(set(texts)) >= 4  # the walk reaches many, so none is unreachable by escaping


def test_choice_of_prefixes(compiler: GrammarCompiler, tiny_tokenizer: Tokenizer) -> None:
    """Choices that are prefixes of each other may each be produced (EOS is allowed after the
    short one, more text too)."""
    texts = walks(compiler, tiny_tokenizer, StructuredOutputsParams(choice=("a", "ab", "abc")), 30)
    assert set(texts) == {"a", "ab", "abc"}


@pytest.mark.parametrize("grammar", [ARITH_LARK, ARITH_GBNF], ids=["lark", "gbnf"])
def test_grammar_walks_parse(
    compiler: GrammarCompiler, tiny_tokenizer: Tokenizer, grammar: str
) -> None:
    """A Lark grammar, and the same grammar in GBNF, yield arithmetic that Python's parser
    reads as one expression of numbers and operators."""
    for text in walks(compiler, tiny_tokenizer, StructuredOutputsParams(grammar=grammar), 12):
        tree = ast.parse(text, mode="eval")
        allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
        assert all(isinstance(node, allowed) for node in ast.walk(tree)), text


def test_structural_tag_constrains_inside_the_tag(
    compiler: GrammarCompiler, tiny_tokenizer: Tokenizer
) -> None:
    """Free text until a trigger; from a structure's begin the arguments follow its schema and
    then its end (vLLM's structures/triggers shape)."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<function=get_weather>", "schema": schema, "end": "</function>"}],
        "triggers": ["<function="],
    }
    params = StructuredOutputsParams(structural_tag=json.dumps(tag))
    grammar = compiler.compile(params)
    ended = 0
    for seed in range(10):
        text = walk(compiler, tiny_tokenizer, grammar, seed, prefix="Sure. <function=get_weather>")
        if text is None:
            continue
        ended += 1
        body = text.removeprefix("Sure. <function=get_weather>")
        args, sep, _ = body.partition("</function>")
        assert sep, text  # the tag was closed before EOS was allowed
        jsonschema.validate(json.loads(args), schema)
    assert ended >= 5


def test_structural_tag_rejects_a_bad_argument(
    compiler: GrammarCompiler, tiny_tokenizer: Tokenizer
) -> None:
    """Inside a triggered tag, text outside the schema is refused."""
    tag = {
        "structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}],
        "triggers": ["<f>"],
    }
    m = compiler.compile(StructuredOutputsParams(structural_tag=json.dumps(tag))).matcher()
    assert m.consume_tokens(tiny_tokenizer.encode("hi <f>", add_special_tokens=False))
    assert not m.consume_tokens(tiny_tokenizer.encode('"x"', add_special_tokens=False))


def test_padded_vocab_ids_never_allowed(
    compiler: GrammarCompiler, tiny_tokenizer: Tokenizer
) -> None:
    """Ids past the tokenizer (the logits' padding) are in no mask, even where anything goes;
    EOS is allowed exactly where the grammar may end."""
    m = compiler.compile(StructuredOutputsParams(regex=r"(.|\n)*")).matcher()
    ids = set(allowed_ids(matcher_mask(m, TINY_VOCAB), TINY_VOCAB).tolist())
    assert len(tiny_tokenizer) == 512
    assert not ids & set(range(512, TINY_VOCAB))
    assert EOS_TOKEN_ID in ids and len(ids) > 400
    m = compiler.compile(StructuredOutputsParams(regex="ab")).matcher()
    assert EOS_TOKEN_ID not in allowed_ids(matcher_mask(m, TINY_VOCAB), TINY_VOCAB)
    assert m.consume_tokens(tiny_tokenizer.encode("ab", add_special_tokens=False))
    assert allowed_ids(matcher_mask(m, TINY_VOCAB), TINY_VOCAB).tolist() == [EOS_TOKEN_ID]
    assert m.is_stopped() or m.is_accepting()


def test_any_whitespace_is_vllm_default(tiny_tokenizer: Tokenizer) -> None:
    """By default JSON may hold free whitespace (vLLM's default); any_whitespace=False forbids
    it (vLLM's disable_any_whitespace)."""
    text = tiny_tokenizer.encode('{ "a" : 1 }', add_special_tokens=False)
    for flexible in (True, False):
        c = GrammarCompiler(tiny_tokenizer, TINY_VOCAB, [EOS_TOKEN_ID], any_whitespace=flexible)
        m = c.compile(StructuredOutputsParams(json_object=True)).matcher()
        assert m.consume_tokens(text) is flexible


def test_additional_properties_follow_the_spec(
    compiler: GrammarCompiler, tiny_tokenizer: Tokenizer
) -> None:
    """A schema that says nothing of other properties allows them (the JSON schema default, as
    vLLM's guidance backend leaves it); strict_json_schema closes every such object."""
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}}}}
    extra = tiny_tokenizer.encode('{"a":{"z":1},"b":2}', add_special_tokens=False)
    m = compiler.compile(StructuredOutputsParams(json=json.dumps(schema))).matcher()
    assert m.consume_tokens(extra)
    strict = strict_json_schema(schema)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy
    m = compiler.compile(StructuredOutputsParams(json=json.dumps(strict))).matcher()
    assert not m.consume_tokens(extra)


def test_compile_is_cached_and_thread_safe(tiny_tokenizer: Tokenizer) -> None:
    """Equal params compile once, also when threads ask at the same time; the cache is an LRU
    of the given size; each matcher is independent of the others."""
    c = GrammarCompiler(tiny_tokenizer, TINY_VOCAB, [EOS_TOKEN_ID], cache_size=2)
    params = StructuredOutputsParams(json=json.dumps(PERSON))
    results: list[Grammar] = []
    threads = [threading.Thread(target=lambda: results.append(c.compile(params))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(g is results[0] for g in results)
    a, b = results[0].matcher(), results[0].matcher()
    assert a.consume_tokens(tiny_tokenizer.encode('{"name"', add_special_tokens=False))
    # b starts where a did, not where a is now
    assert b.consume_tokens(tiny_tokenizer.encode('{"name":"bo"', add_special_tokens=False))
    assert not a.consume_tokens(tiny_tokenizer.encode("{", add_special_tokens=False))
    c.compile(StructuredOutputsParams(regex="a"))
    c.compile(StructuredOutputsParams(regex="b"))
    assert c.compile(params) is not results[0]  # evicted, compiled again


BAD = [
    (StructuredOutputsParams(json='{"type": "object"'), r"json is not valid JSON"),
    (StructuredOutputsParams(json="[1, 2]"), r"json must be a JSON schema object"),
    (StructuredOutputsParams(json='{"type": "strnig"}'), r"json: .*strnig"),
    (
        StructuredOutputsParams(json='{"type": "integer", "minimum": 5, "maximum": 3}'),
        r"json: .*minimum",
    ),
    (StructuredOutputsParams(json='{"$ref": "#/$defs/missing"}'), r"json: .*missing"),
    (
        StructuredOutputsParams(json='{"type": "string", "pattern": "a(?=b)"}'),
        r"(?s)json: .*look-around",
    ),
    (
        StructuredOutputsParams(regex="a["),
        r"(?s)^structured_outputs\.regex: invalid regex .*unclosed character",
    ),
    (StructuredOutputsParams(regex="(?<=a)b"), r"(?s)regex: .*look-around"),
    (StructuredOutputsParams(grammar="start: missing_rule"), r"grammar: .*missing_rule"),
    (StructuredOutputsParams(grammar='start: "a" ("b"'), r"^structured_outputs\.grammar: "),
    (StructuredOutputsParams(grammar='root ::= "a" | ('), r"grammar is not valid GBNF"),
    (StructuredOutputsParams(structural_tag="{"), r"structural_tag is not valid JSON"),
    (
        StructuredOutputsParams(structural_tag='{"structures": [], "triggers": ["<f"]}'),
        r"structures must be a non-empty list",
    ),
    (
        StructuredOutputsParams(
            structural_tag=json.dumps(
                {"structures": [{"begin": "<g>", "schema": {}, "end": "</g>"}], "triggers": ["<f"]}
            )
        ),
        r"structures\[0\]\.begin '<g>' starts with none of the triggers",
    ),
    (
        StructuredOutputsParams(
            structural_tag=json.dumps(
                {
                    "structures": [{"begin": "<f>", "schema": {"type": "nope"}, "end": "</f>"}],
                    "triggers": ["<f"],
                }
            )
        ),
        r"structural_tag: .*nope",
    ),
    (
        StructuredOutputsParams(structural_tag='{"type": "structural_tag", "format": {}}'),
        r"only the structures/triggers form",
    ),
]


@pytest.mark.parametrize(("params", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_constraints_are_grammar_errors(
    compiler: GrammarCompiler, params: StructuredOutputsParams, message: str
) -> None:
    """validate() and compile() both reject a bad constraint with a GrammarError (a
    ValueError) whose message names the field and the problem."""
    for check in (compiler.validate, compiler.compile):
        with pytest.raises(GrammarError, match=message) as info:
            check(params)
        assert isinstance(info.value, ValueError)
        assert str(info.value).startswith("structured_outputs."), info.value


def test_failed_compiles_are_not_cached(compiler: GrammarCompiler) -> None:
    """A failure is raised again on the next compile, not served from the cache."""
    bad = StructuredOutputsParams(regex="(")
    for _ in range(2):
        with pytest.raises(GrammarError):
            compiler.compile(bad)


def test_good_constraints_validate(compiler: GrammarCompiler) -> None:
    """Every kind's valid form passes validate()."""
    for params in (
        StructuredOutputsParams(json=json.dumps(PERSON)),
        StructuredOutputsParams(json="true"),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"\d+"),
        StructuredOutputsParams(choice=("a", "")),
        StructuredOutputsParams(grammar=ARITH_LARK),
        StructuredOutputsParams(grammar=ARITH_GBNF),
        StructuredOutputsParams(
            structural_tag=json.dumps(
                {"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["<f>"]}
            )
        ),
    ):
        compiler.validate(params)


# -- property-based schemas ---------------------------------------------------------------------


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_random_schemas_walks_validate(
    compiler: GrammarCompiler, tiny_tokenizer: Tokenizer, schema: dict[str, Any], seed: int
) -> None:
    """Random nested schemas (objects with required and closed properties, arrays with
    minItems/maxItems, enums, patterns, bounded integers): every walk that ends validates."""
    params = StructuredOutputsParams(json=json.dumps(schema))
    compiler.validate(params)
    grammar = compiler.compile(params)
    for s in range(3):
        text = walk(compiler, tiny_tokenizer, grammar, seed + s, max_tokens=600)
        if text is not None:
            jsonschema.validate(json.loads(text), schema)


# -- SmolLM2's real tokenizer ---------------------------------------------------------------------


def test_smollm2_walks(smollm2: tuple[Tokenizer, GrammarCompiler]) -> None:
    """On SmolLM2's 49k-token vocabulary: a schema, a regex and a choice each walk to valid
    text, and the chat end token is the EOS the masks allow."""
    tok, compiler = smollm2
    for text in walks(compiler, tok, StructuredOutputsParams(json=json.dumps(PERSON)), 4):
        jsonschema.validate(json.loads(text), PERSON)
    pattern = r"[A-Z][a-z]{2,5} [0-9]{1,3}"
    for text in walks(compiler, tok, StructuredOutputsParams(regex=pattern), 4):
        assert re.fullmatch(pattern, text), text
    choices = ("positive", "negative", "neutral ✓")
    assert set(walks(compiler, tok, StructuredOutputsParams(choice=choices), 6)) <= set(choices)


def test_special_token_trigger(compiler: GrammarCompiler, tiny_tokenizer: Tokenizer) -> None:
    """A trigger that is one of the tokenizer's special tokens is matched as that token: the
    token id opens the tag, after it the schema rules."""
    start = tiny_tokenizer.encode("<|im_start|>", add_special_tokens=False)
    assert len(start) == 1
    tag = {
        "structures": [{"begin": "<|im_start|>", "schema": {"type": "integer"}, "end": "."}],
        "triggers": ["<|im_start|>"],
    }
    grammar = compiler.compile(StructuredOutputsParams(structural_tag=json.dumps(tag)))
    m = grammar.matcher()
    assert m.consume_tokens(tiny_tokenizer.encode("ok ", add_special_tokens=False) + start)
    assert m.consume_tokens(tiny_tokenizer.encode("42.", add_special_tokens=False))
    m = grammar.matcher()
    assert m.consume_tokens(start)
    assert not m.consume_tokens(tiny_tokenizer.encode("x", add_special_tokens=False))


def test_backend_is_torch_free() -> None:
    """The API process may import the backend: it pulls in neither torch nor numpy."""
    code = (
        "import sys, baton.engine.structured.backend; "
        "sys.exit(any(m in sys.modules for m in ('torch', 'numpy')))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
