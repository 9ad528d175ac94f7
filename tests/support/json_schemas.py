"""Random JSON schemas for property-based tests of structured outputs: nested objects (some
properties required, some objects closed), arrays with minItems/maxItems, enums, string patterns,
bounded integers and numbers. `CLOSED_SCHEMAS` are the finite ones, whose every answer is
bounded in length."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

_LEAVES = st.one_of(
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-1000, 1000),
        st.integers(0, 2000),
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.sampled_from(
        [
            {"type": "string", "pattern": "^[a-z]{1,4}$"},
            {"type": "string", "pattern": "^[0-9]{3}-[0-9]{2}$"},
            {"type": "number", "minimum": 0, "maximum": 1},
        ]
    ),
    st.lists(
        st.one_of(st.integers(-5, 5), st.sampled_from(["x", "y z", 'q"'])),
        min_size=1,
        max_size=4,
        unique=True,
    ).map(lambda values: {"enum": values}),
)

_NAMES = st.text(alphabet="abcdefgh_", min_size=1, max_size=5)


def _containers(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    arrays = st.builds(
        lambda items, lo, span: {
            "type": "array",
            "items": items,
            "minItems": lo,
            "maxItems": lo + span,
        },
        children,
        st.integers(0, 2),
        st.integers(0, 2),
    )
    objects = st.dictionaries(_NAMES, children, min_size=1, max_size=3).flatmap(
        lambda props: st.builds(
            lambda required, closed: {
                "type": "object",
                "properties": props,
                "required": required,
                "additionalProperties": not closed,
            },
            st.lists(st.sampled_from(sorted(props)), unique=True),
            st.booleans(),
        )
    )
    return st.one_of(arrays, objects)


SCHEMAS: st.SearchStrategy[dict[str, Any]] = st.recursive(_LEAVES, _containers, max_leaves=6)


def _closed(node: Any) -> Any:
    if isinstance(node, list):
        return [_closed(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) for k, v in node.items()}
    if out.get("type") == "object":
        out["additionalProperties"] = False
    if out.get("type") == "number":  # a fraction has no length bound: "0.8514214888888..."
        out["type"] = "integer"
    return out


# The same with every object closed and every number an integer: an open object lets a model add
# properties without end, and a number's fraction digits have no end either (a random model's
# answer to {"type": "number", "maximum": 1} can run to max_tokens, as it can in vLLM), so only
# these bound every answer (what a test that needs every answer to end wants). SCHEMAS keeps both
# for the tests that check only that what is produced validates.
CLOSED_SCHEMAS: st.SearchStrategy[dict[str, Any]] = SCHEMAS.map(_closed)
