"""Idempotent apply of one desired child: the merge patch that brings the live object to the
desired one, or None when nothing changed (then nothing is written, so an unchanged spec makes
no API writes and no watch events).

Like `kubectl apply`, each child remembers the last desired object in an annotation, so a field
the operator stopped setting is removed (three-way merge) while fields that other controllers
own (a Service's clusterIP, defaults the API server fills in) are left alone.
"""

from __future__ import annotations

import json
from typing import Any

LAST_APPLIED = "baton.dev/last-applied"
# Fields the operator may stop setting because another controller takes them over (the HPA
# owns `spec.replicas` once autoscaling is on); they are never removed.
HANDED_OFF: frozenset[tuple[str, ...]] = frozenset({("spec", "replicas")})

Manifest = dict[str, Any]


def with_last_applied(desired: Manifest) -> Manifest:
    """`desired` with its own JSON in the last-applied annotation."""
    meta = dict(desired["metadata"])
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k != LAST_APPLIED}
    bare = {**desired, "metadata": {**meta, "annotations": annotations}}
    if not annotations:
        del bare["metadata"]["annotations"]
    annotations[LAST_APPLIED] = json.dumps(bare, sort_keys=True, separators=(",", ":"))
    return {**desired, "metadata": {**meta, "annotations": annotations}}


def apply_patch(live: Manifest, desired: Manifest) -> Manifest | None:
    """The merge patch from `live` to `desired` (which carries its last-applied annotation), or
    None when `live` already has every desired field and none of the removed ones."""
    raw = (live.get("metadata", {}).get("annotations") or {}).get(LAST_APPLIED, "{}")
    try:
        last = json.loads(raw)
    except ValueError:
        last = {}
    removals = _removals(last, desired, ())
    if contains(live, desired) and not _present(live, removals):
        return None
    return _merge(desired, removals)


def contains(live: Any, desired: Any) -> bool:
    """Whether `live` has every field of `desired` (extra fields in `live` are defaults or
    belong to someone else); lists must match element by element."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            key in live and contains(live[key], value) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(contains(a, b) for a, b in zip(live, desired, strict=True))
        )
    if isinstance(desired, int | float) and not isinstance(desired, bool) and isinstance(live, str):
        return str(desired) == live  # the API server turns quantities like 2 into "2"
    return bool(live == desired)


def _removals(last: Any, desired: Any, path: tuple[str, ...]) -> Manifest:
    """Merge-patch nulls for the keys set last time and not any more."""
    if not isinstance(last, dict) or not isinstance(desired, dict):
        return {}
    result: Manifest = {}
    for key, value in last.items():
        if key not in desired:
            if (*path, key) not in HANDED_OFF:
                result[key] = None
        else:
            nested = _removals(value, desired[key], (*path, key))
            if nested:
                result[key] = nested
    return result


def _present(live: Any, removals: Manifest) -> bool:
    for key, value in removals.items():
        if isinstance(live, dict) and key in live and (value is None or _present(live[key], value)):
            return True
    return False


def _merge(desired: Manifest, removals: Manifest) -> Manifest:
    result = dict(desired)
    for key, value in removals.items():
        if value is None:
            result[key] = None
        elif isinstance(result.get(key), dict):
            result[key] = _merge(result[key], value)
    return result
