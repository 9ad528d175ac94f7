"""Checks an `InferenceService` spec the way the API server would (the CRD schema's types,
enums, bounds, required fields, defaults and pruning), so the operator never trusts that the
installed CRD matches its own; `spec.py` adds the checks a schema cannot express.
"""

from __future__ import annotations

import copy
from typing import Any

from baton.operator.crd import SPEC, Schema


class SpecError(ValueError):
    """A spec the operator cannot serve: `reason` is a CamelCase condition reason and `message`
    says what to change."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def defaulted_spec(spec: Any) -> dict[str, Any]:
    """A copy of `spec` with the schema's defaults filled in and unknown fields dropped; raises
    `SpecError("InvalidSpec", ...)` naming the first field that breaks the schema."""
    result: dict[str, Any] = _apply(SPEC, copy.deepcopy(spec), "spec")
    return result


def _apply(schema: Schema, value: Any, path: str) -> Any:
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise SpecError("InvalidSpec", f"{path} must be an integer or a string")
        return value
    kind = schema.get("type")
    if kind == "object":
        return _apply_object(schema, value, path)
    if kind == "array":
        if not isinstance(value, list):
            raise SpecError("InvalidSpec", f"{path} must be a list")
        items = schema.get("items", {})
        return [_apply(items, item, f"{path}[{i}]") for i, item in enumerate(value)]
    if kind == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
        raise SpecError("InvalidSpec", f"{path} must be an integer, got {value!r}")
    if kind == "number" and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise SpecError("InvalidSpec", f"{path} must be a number, got {value!r}")
    if kind == "string" and not isinstance(value, str):
        raise SpecError("InvalidSpec", f"{path} must be a string, got {value!r}")
    if kind == "boolean" and not isinstance(value, bool):
        raise SpecError("InvalidSpec", f"{path} must be true or false, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        raise SpecError("InvalidSpec", f"{path} must be one of {schema['enum']}, got {value!r}")
    if schema.get("exclusiveMinimum") and value <= schema["minimum"]:
        raise SpecError("InvalidSpec", f"{path} must be above {schema['minimum']}, got {value}")
    if "minimum" in schema and value < schema["minimum"]:
        raise SpecError("InvalidSpec", f"{path} must be at least {schema['minimum']}, got {value}")
    if "maximum" in schema and value > schema["maximum"]:
        raise SpecError("InvalidSpec", f"{path} must be at most {schema['maximum']}, got {value}")
    if "minLength" in schema and len(value) < schema["minLength"]:
        raise SpecError("InvalidSpec", f"{path} must not be empty")
    return value


def _apply_object(schema: Schema, value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SpecError("InvalidSpec", f"{path} must be an object")
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return value
    for name in schema.get("required", []):
        if name not in value:
            raise SpecError("InvalidSpec", f"{path}.{name} is required")
    properties: dict[str, Schema] = schema.get("properties", {})
    extra: Schema | None = schema.get("additionalProperties")
    result: dict[str, Any] = {}
    for name, item in value.items():
        if name in properties:
            result[name] = _apply(properties[name], item, f"{path}.{name}")
        elif extra is not None:
            result[name] = _apply(extra, item, f"{path}.{name}")
        # else: pruned, as the API server prunes fields a structural schema does not know
    for name, prop in properties.items():
        if name not in result and "default" in prop:
            result[name] = _apply(prop, copy.deepcopy(prop["default"]), f"{path}.{name}")
    return result
