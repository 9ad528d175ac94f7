"""Server-side apply as the emulated API server does it: a reasonable approximation of
Kubernetes' structured merge, without its schemas.

An applied object is merged into the stored one: maps recursively; lists of named items
(containers, env, volumes, ports, owner references, conditions) item by item, by their merge key;
any other list is replaced whole. Each field manager owns the set of fields it applied, recorded
in `metadata.managedFields` in Kubernetes' `FieldsV1` form, so a field that a manager stops
applying is removed when no other manager owns it, and applying a field that another manager
owns with a different value is a conflict unless forced (then the applier takes it over). Only
apply operations are tracked; other writes leave `managedFields` as they are.
"""

from __future__ import annotations

import copy
import datetime
import json
from typing import Any

FieldPath = tuple[str, ...]  # "f:spec", "f:containers", 'k:{"name":"engine"}', "f:image"
Manifest = dict[str, Any]

# Merge keys of lists that Kubernetes merges item by item, by the list's field name; any other
# list of objects that all carry a `name` merges by name (containers, env, volumes, mounts).
LIST_KEYS: dict[str, tuple[str, ...]] = {
    "ports": ("containerPort", "port"),
    "ownerReferences": ("uid",),
    "conditions": ("type",),
}
# Set by the server, never owned by a manager.
SERVER_FIELDS = frozenset(
    {"name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp"}
    | {"managedFields", "deletionTimestamp", "selfLink"}
)


class Conflict(Exception):
    """Fields the applier would change that other managers own."""

    def __init__(self, conflicts: list[tuple[str, FieldPath]]) -> None:
        names = ", ".join(f"{'.'.join(p)} (owned by {m!r})" for m, p in conflicts)
        super().__init__(f"Apply failed with {len(conflicts)} conflicts: {names}")
        self.conflicts = conflicts


def list_key(field: str, items: list[Any]) -> str | None:
    """The key that a list named `field` merges by, or None when it is replaced whole."""
    if not items or not all(isinstance(item, dict) for item in items):
        return None
    for key in (*LIST_KEYS.get(field, ()), "name"):
        if all(key in item for item in items):
            return key
    return None


def _item_segment(key: str, item: Manifest) -> str:
    return "k:" + json.dumps({key: item[key]}, separators=(",", ":"))


def field_set(obj: Manifest) -> set[FieldPath]:
    """The fields an applied object sets: its leaves, and each keyed list item itself."""
    top = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k not in SERVER_FIELDS}
    if meta:
        top["metadata"] = meta
    else:
        top.pop("metadata", None)
    return set(_fields(top, ()))


def _fields(node: Manifest, prefix: FieldPath) -> list[FieldPath]:
    paths: list[FieldPath] = []
    for field, value in node.items():
        path = (*prefix, f"f:{field}")
        key = list_key(field, value) if isinstance(value, list) else None
        if isinstance(value, dict) and value:
            paths += _fields(value, path)
        elif key is not None:
            for item in value:
                item_path = (*path, _item_segment(key, item))
                paths += [item_path, *_fields(item, item_path)]
        else:
            paths.append(path)
    return paths


def _step(node: Any, segment: str) -> Any:
    if segment.startswith("f:"):
        return node.get(segment[2:]) if isinstance(node, dict) else None
    wanted = json.loads(segment[2:])
    for item in node if isinstance(node, list) else []:
        if isinstance(item, dict) and all(item.get(k) == v for k, v in wanted.items()):
            return item
    return None


def value_at(obj: Any, path: FieldPath) -> Any:
    for segment in path:
        obj = _step(obj, segment)
        if obj is None:
            return None
    return obj


def merge(live: Any, applied: Any, field: str = "") -> Any:
    """`applied` merged into `live` (see the module docstring)."""
    if isinstance(applied, dict) and isinstance(live, dict):
        result = copy.deepcopy(live)
        for key, value in applied.items():
            result[key] = merge(live.get(key), value, key)
        return result
    key = list_key(field, applied) if isinstance(applied, list) else None
    if key is not None and isinstance(live, list) and list_key(field, live) == key:
        result = copy.deepcopy(live)
        for item in applied:
            index = next((i for i, old in enumerate(result) if old.get(key) == item[key]), None)
            if index is None:
                result.append(copy.deepcopy(item))
            else:
                result[index] = merge(result[index], item)
        return result
    return copy.deepcopy(applied)


def remove(node: Any, path: FieldPath) -> None:
    """Deletes the field at `path`, and the maps and lists that it leaves empty."""
    if not path or node is None:
        return
    segment, rest = path[0], path[1:]
    child = _step(node, segment)
    if child is None:
        return
    if rest:
        remove(child, rest)
        if child not in ({}, []):
            return
    if segment.startswith("f:"):
        del node[segment[2:]]
    else:
        node.remove(child)


def to_fields_v1(paths: set[FieldPath]) -> Manifest:
    tree: Manifest = {}
    for path in sorted(paths):
        node = tree
        for segment in path:
            node = node.setdefault(segment, {})
        if path[-1].startswith("k:"):
            node["."] = {}
    return tree


def from_fields_v1(tree: Manifest, prefix: FieldPath = ()) -> set[FieldPath]:
    paths: set[FieldPath] = set()
    for segment, sub in tree.items():
        if segment == ".":
            paths.add(prefix)
        elif sub:
            paths |= from_fields_v1(sub, (*prefix, segment))
        else:
            paths.add((*prefix, segment))
    return paths


def managers(obj: Manifest | None) -> dict[str, tuple[Manifest, set[FieldPath]]]:
    """Manager -> (its managedFields entry, the fields it owns)."""
    result: dict[str, tuple[Manifest, set[FieldPath]]] = {}
    for entry in ((obj or {}).get("metadata") or {}).get("managedFields") or []:
        result[entry["manager"]] = (entry, from_fields_v1(entry.get("fieldsV1") or {}))
    return result


def apply(live: Manifest | None, applied: Manifest, manager: str, force: bool) -> Manifest:
    """The object after `manager` applies `applied` to `live` (None: it does not exist yet);
    raises `Conflict` for fields other managers own with other values, unless `force`."""
    owners = managers(live)
    wanted = field_set(applied)
    conflicts = [
        (other, path)
        for other, (_, owned) in owners.items()
        if other != manager
        for path in sorted(owned & wanted)
        if path[-1].startswith("f:") and value_at(live, path) != value_at(applied, path)
    ]
    if conflicts and not force:
        raise Conflict(conflicts)
    for other, path in conflicts:
        owners[other][1].discard(path)
    result = merge(copy.deepcopy(live) if live is not None else {}, applied)
    kept = set().union(*(owned for other, (_, owned) in owners.items() if other != manager))
    still = kept | wanted
    previous = owners.get(manager, ({}, set()))[1]
    for path in sorted(previous - wanted, key=len, reverse=True):
        if not any(p[: len(path)] == path for p in still):
            remove(result, path)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    old_entry, _ = owners.get(manager, ({}, set()))
    unchanged = previous == wanted and _without_managed(result) == _without_managed(live)
    mine = {
        "manager": manager,
        "operation": "Apply",
        "apiVersion": applied.get("apiVersion", ""),
        # A no-op apply writes nothing on a real server, so its time does not move either.
        "time": old_entry.get("time", now) if unchanged else now,
        "fieldsType": "FieldsV1",
        "fieldsV1": to_fields_v1(wanted),
    }
    entries = [
        mine if other == manager else {**entry, "fieldsV1": to_fields_v1(owned)}
        for other, (entry, owned) in owners.items()
        if other == manager or owned
    ]
    if manager not in owners:
        entries.append(mine)
    result.setdefault("metadata", {})["managedFields"] = entries
    return result


def _without_managed(obj: Manifest | None) -> Manifest | None:
    if obj is None:
        return None
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}
    return {**obj, "metadata": meta}
