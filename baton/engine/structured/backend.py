"""The grammar backend: every kind of `StructuredOutputsParams` mapped to an llguidance grammar,
checked at the API edge (`validate`) and compiled, once per distinct constraint, into matchers
for the engine (`compile`). Torch-free (llguidance only), so the API process may import it.

The mapping follows vLLM's guidance backend (vllm/v1/structured_output/backend_guidance.py,
`serialize_guidance_grammar`): JSON schemas with flexible whitespace and the spec's
additionalProperties default, `{"type": "object"}` for json_object, a Lark alternation of JSON
string literals for choice, GBNF converted to Lark, and structural tags as llguidance `StructTag`s
whose trigger is the first of the request's triggers that begins the structure's `begin`.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

from baton.engine.config import StructuredOutputsConfig
from baton.engine.sampling_params import STRUCTURED_OUTPUT_KINDS, StructuredOutputsParams
from baton.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# JSON schema keywords whose value maps names to subschemas, and those whose value is a
# subschema or a list of them: where `strict_json_schema` looks for nested objects.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = (
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "items",
    "prefixItems",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
)


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message names the field and the problem, and
    the API answers it with a 400."""


class Grammar:
    """One compiled constraint. Compiling (building the lexer and parser over the vocabulary)
    is the costly part; a request's matcher is a copy of a pristine prototype, so many requests
    with the same constraint share one compile."""

    def __init__(self, prototype: llguidance.LLMatcher) -> None:
        self._prototype = prototype
        # The prototype is never advanced; the lock only keeps concurrent copies apart, as the
        # compile pool and the scheduler may copy it at once.
        self._lock = threading.Lock()

    def matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start, owned by one request."""
        with self._lock:
            return self._prototype.deep_copy()


class GrammarCompiler:
    """Turns `StructuredOutputsParams` into `Grammar`s for one model.

    `vocab_size` is the model's logits width, which may exceed the tokenizer's (padded
    embeddings): ids past the tokenizer's are no token and never allowed. `eos_token_ids` are
    the model's end tokens; a mask allows them exactly where the grammar may end.
    `any_whitespace=False` is vLLM's `disable_any_whitespace`: JSON without free whitespace;
    `additional_properties=False` its `disable_additional_properties`. `from_config` makes one
    as the engine's `StructuredOutputsConfig` says.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        any_whitespace: bool = True,
        additional_properties: bool = True,
        cache_size: int = 64,
    ) -> None:
        eos = [int(t) for t in eos_token_ids]
        if not eos:
            raise ValueError("a grammar compiler needs at least one EOS token id")
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if cache_size < 1:
            raise ValueError(f"cache_size must be at least 1, got {cache_size}")
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(eos)
        self.any_whitespace = any_whitespace
        self.additional_properties = additional_properties
        # llguidance reads the tokenizers JSON itself (the added tokens Baton's Tokenizer put
        # in included); sized to cover both the logits and every token it knows.
        self.ll_tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(),
            n_vocab=max(self.vocab_size, len(tokenizer)),
            eos_token=eos,
        )
        # Triggers written like `<tool_call>` are matched as special tokens when the tokenizer
        # has them as such (llguidance's default); otherwise as text.
        self._special_tokens = frozenset(
            t.content for t in tokenizer.backend.get_added_tokens_decoder().values() if t.special
        )
        self._cache_size = cache_size
        self._cache: OrderedDict[StructuredOutputsParams, Future[Grammar]] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_config(
        cls,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        config: StructuredOutputsConfig,
    ) -> GrammarCompiler:
        return cls(
            tokenizer,
            vocab_size,
            eos_token_ids,
            any_whitespace=not config.disable_any_whitespace,
            additional_properties=not config.disable_additional_properties,
        )

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raises `GrammarError` when `params` cannot compile. Checks the grammar's syntax and
        semantics without building the lexer over the vocabulary, so it is cheap enough for the
        API edge."""
        serialized = self._serialize(params)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            serialized, self.ll_tokenizer
        )
        if is_error:
            raise GrammarError(_describe(params, messages[0] if messages else "invalid grammar"))

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """The grammar for `params`, compiled once and kept in an LRU cache; threads asking
        for the same params while it compiles wait for that one compile. Raises `GrammarError`
        (failures are not cached)."""
        with self._lock:
            future = self._cache.get(params)
            owner = future is None
            if future is None:
                future = Future()
                self._cache[params] = future
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(params)
        if not owner:
            return future.result()
        try:
            grammar = self._build(params)
        except BaseException as e:
            with self._lock:
                if self._cache.get(params) is future:
                    del self._cache[params]
            future.set_exception(e)
            raise
        future.set_result(grammar)
        return grammar

    def _build(self, params: StructuredOutputsParams) -> Grammar:
        # The constructor never raises for a bad grammar: the matcher is born in an error
        # state instead. It releases the GIL while it builds.
        matcher = llguidance.LLMatcher(self.ll_tokenizer, self._serialize(params), log_level=0)
        if matcher.is_error():
            raise GrammarError(_describe(params, matcher.get_error()))
        for warning in matcher.get_grammar_warnings():
            logger.warning("structured outputs grammar: %s", warning)
        return Grammar(matcher)

    def _serialize(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar for `params`, without checking it."""
        if params.json is not None:
            return self._json_grammar(_load_json(params.json, "structured_outputs.json"))
        if params.json_object:
            return self._json_grammar({"type": "object"})
        if params.regex is not None:
            return str(llguidance.LLMatcher.grammar_from_regex(params.regex))
        if params.choice is not None:
            # JSON string literals are Lark string literals: quotes, backslashes, control
            # characters and non-ASCII text are escaped, so a choice matches itself only.
            lark = "start: " + " | ".join(json.dumps(c) for c in params.choice)
            return str(llguidance.LLMatcher.grammar_from_lark(lark))
        if params.grammar is not None:
            return str(llguidance.LLMatcher.grammar_from_lark(_to_lark(params.grammar)))
        if params.structural_tag is not None:
            return self._structural_tag_grammar(params.structural_tag)
        raise GrammarError("structured_outputs sets no constraint")  # __post_init__ forbids it

    def _json_grammar(self, schema: Any) -> str:
        if not isinstance(schema, dict | bool):
            raise GrammarError(
                f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}"
            )
        # Boolean schemas are the spec's "anything" and "nothing"; llguidance wants an object.
        if schema is False:
            raise GrammarError("structured_outputs.json: the schema false matches nothing")
        if schema is True:
            schema = {}
        if not self.additional_properties:
            schema = strict_json_schema(schema)
        try:
            return str(
                llguidance.LLMatcher.grammar_from_json_schema(
                    schema, defaults={"whitespace_flexible": self.any_whitespace}
                )
            )
        except ValueError as e:
            raise GrammarError(f"structured_outputs.json: {e}") from e

    def _structural_tag_grammar(self, text: str) -> str:
        field = "structured_outputs.structural_tag"
        spec = _load_json(text, field)
        if not isinstance(spec, dict):
            raise GrammarError(f"{field} must be a JSON object")
        if spec.get("type", "structural_tag") != "structural_tag":
            raise GrammarError(f"{field}.type must be 'structural_tag', got {spec['type']!r}")
        if "format" in spec and "structures" not in spec:
            raise GrammarError(
                f"{field}: only the structures/triggers form is supported, not 'format'"
            )
        structures, triggers = spec.get("structures"), spec.get("triggers")
        if not isinstance(structures, list) or not structures:
            raise GrammarError(f"{field}.structures must be a non-empty list")
        if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
            raise GrammarError(f"{field}.triggers must be a list of non-empty strings")
        tags = []
        for i, s in enumerate(structures):
            where = f"{field}.structures[{i}]"
            if not isinstance(s, dict):
                raise GrammarError(f"{where} must be an object with begin, schema and end")
            begin, end = s.get("begin"), s.get("end")
            if not isinstance(begin, str) or not isinstance(end, str):
                raise GrammarError(f"{where}.begin and .end must be strings")
            trigger = next((t for t in triggers if begin.startswith(t)), None)
            if trigger is None:
                raise GrammarError(f"{where}.begin {begin!r} starts with none of the triggers")
            # vLLM reads the structure's JSON schema from "schema" ("parameters" is its alias
            # in the request); a structure without one takes any JSON value.
            schema = s.get("schema", s.get("parameters"))
            schema = {} if schema is None or schema is True else schema
            if not isinstance(schema, dict):
                raise GrammarError(f"{where}.schema must be a JSON schema object")
            tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end))
        bracketed = [t for t in triggers if t.startswith("<") and t.endswith(">")]
        special = all(t in self._special_tokens for t in bracketed)
        return str(llguidance.StructTag.to_grammar(tags, assume_special=special))


def strict_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with `additionalProperties: false` on every object schema that lists properties
    and says nothing about others: what OpenAI's `strict: true` means, and vLLM's
    `disable_additional_properties` option. A copy; `schema` is untouched."""
    out = copy.deepcopy(schema)
    _close_objects(out)
    return out


def _close_objects(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _close_objects(item)
        return
    if not isinstance(node, dict):
        return
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for sub in node[key].values():
                _close_objects(sub)
    for key in _SUBSCHEMAS:
        if isinstance(node.get(key), dict | list):
            _close_objects(node[key])
    if "additionalProperties" not in node and (
        isinstance(node.get("properties"), dict) or isinstance(node.get("patternProperties"), dict)
    ):
        node["additionalProperties"] = False


def _load_json(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"{field} is not valid JSON: {e}") from e


def _to_lark(grammar: str) -> str:
    # GBNF (llama.cpp's grammars) is told apart by its `::=` rules; a Lark grammar with a
    # `start:` rule stays Lark even if a literal in it holds "::=".
    if "::=" not in grammar or is_lark_syntax(grammar):
        return grammar
    try:
        return str(gbnf_to_lark(grammar))
    except Exception as e:  # the converter raises plain exceptions for syntax errors
        raise GrammarError(f"structured_outputs.grammar is not valid GBNF: {e}") from e


def _describe(params: StructuredOutputsParams, message: str) -> str:
    """llguidance's message under the name of the field it is about, without the excerpt of
    the internal Lark text it appends (which the user did not write for a regex or a schema)."""
    kind = next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(params, k) not in (None, False))
    message = message.strip()
    if kind != "grammar":
        message = re.sub(r"^at \d+\(\d+\): ", "", message.split("\n   1 |")[0].rstrip())
    return f"structured_outputs.{kind}: {message}"
