"""Idempotent apply: no patch when the live object already matches, the right patch when the
spec changed, a field stopped being set, or someone edited the child."""

from __future__ import annotations

import copy
import json
from typing import Any

from baton.operator.apply import LAST_APPLIED, apply_patch, contains, with_last_applied


def deployment(replicas: int | None = 2, node_selector: dict[str, str] | None = None) -> dict:
    spec: dict[str, Any] = {"template": {"spec": {"containers": [{"name": "e", "image": "b:1"}]}}}
    if replicas is not None:
        spec["replicas"] = replicas
    if node_selector is not None:
        spec["template"]["spec"]["nodeSelector"] = node_selector
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"}, "spec": spec}


def as_served(desired: dict) -> dict:
    """What the API server would hold after creating `desired`: plus defaults and metadata."""
    live = copy.deepcopy(desired)
    live["metadata"] |= {"uid": "u", "resourceVersion": "7"}
    live["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/x"
    live["status"] = {"readyReplicas": 1}
    return live


def test_unchanged_child_needs_no_patch() -> None:
    """Server-side defaults and status do not count as drift."""
    desired = with_last_applied(deployment())
    assert apply_patch(as_served(desired), desired) is None


def test_changed_spec_is_patched() -> None:
    """A new desired value produces a patch carrying it and the new last-applied record."""
    live = as_served(with_last_applied(deployment(replicas=2)))
    desired = with_last_applied(deployment(replicas=5))
    patch = apply_patch(live, desired)
    assert patch is not None and patch["spec"]["replicas"] == 5
    assert json.loads(patch["metadata"]["annotations"][LAST_APPLIED])["spec"]["replicas"] == 5


def test_hand_edits_are_reverted() -> None:
    """A child edited by someone else is patched back even though the spec did not change."""
    desired = with_last_applied(deployment())
    live = as_served(desired)
    live["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:1"
    patch = apply_patch(live, desired)
    assert patch is not None
    assert patch["spec"]["template"]["spec"]["containers"][0]["image"] == "b:1"


def test_fields_no_longer_set_are_removed() -> None:
    """A field set last time and dropped from the spec is removed with a merge-patch null."""
    live = as_served(with_last_applied(deployment(node_selector={"gpu": "h100"})))
    patch = apply_patch(live, with_last_applied(deployment()))
    assert patch is not None and patch["spec"]["template"]["spec"]["nodeSelector"] is None


def test_replicas_handed_to_the_hpa_are_left_alone() -> None:
    """Turning autoscaling on stops setting replicas without resetting what the HPA chose."""
    live = as_served(with_last_applied(deployment(replicas=2)))
    live["spec"]["replicas"] = 7  # the HPA scaled it
    patch = apply_patch(live, with_last_applied(deployment(replicas=None)))
    assert patch is not None and "replicas" not in patch["spec"]  # only the annotation changed
    live["metadata"]["annotations"] = patch["metadata"]["annotations"]
    assert apply_patch(live, with_last_applied(deployment(replicas=None))) is None


def test_contains_treats_quantities_the_server_normalised_as_equal() -> None:
    """An integer quantity the server returns as a string is not drift; other types are."""
    assert contains({"limits": {"nvidia.com/gpu": "2"}}, {"limits": {"nvidia.com/gpu": 2}})
    assert not contains({"a": [1, 2]}, {"a": [1]})
    assert not contains({"a": "true"}, {"a": True})
