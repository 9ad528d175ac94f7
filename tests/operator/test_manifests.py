"""The checked-in manifests: the CRD matches the code, and every manifest, example and child
the operator builds from the examples passes Kubernetes' own schemas in strict mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from baton.operator import crd
from baton.operator.api import PLURALS
from baton.operator.crd import crd_yaml
from baton.operator.reconciler import CHILD_KINDS
from baton.operator.resources import desired_children
from baton.operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
K8S_VERSION = "1.34.0"


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def validate(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    "path",
    [MANIFESTS / "crd.yaml", ROOT / "charts/baton/crds/inferenceservices.yaml"],
    ids=["manifests", "chart"],
)
def test_checked_in_crd_matches_the_code(path: Path) -> None:
    """The CRD files are exactly what `python -m baton.operator.crd` writes."""
    name = path.relative_to(ROOT)
    assert path.read_text() == crd_yaml(), f"{name} is stale: python -m baton.operator.crd > {name}"


@pytest.mark.parametrize("name", ["crd.yaml", "rbac.yaml", "operator.yaml", "gateway.yaml"])
def test_manifests_pass_strict_validation(name: str) -> None:
    """Each manifest passes kubernetes-validate in strict mode."""
    docs = documents(MANIFESTS / name)
    assert docs
    for doc in docs:
        validate(doc)


@pytest.mark.parametrize("name", ["aggregated.yaml", "disaggregated.yaml"])
def test_examples_build_valid_children(name: str) -> None:
    """Each example is a valid spec, and every child built from it passes strict validation."""
    (isvc,) = documents(MANIFESTS / "examples" / name)
    isvc["metadata"]["uid"] = "00000000-0000-0000-0000-000000000001"
    spec = parse_spec(isvc["spec"])
    children = desired_children(isvc, spec)
    for child in children:
        validate(child)
    if name == "disaggregated.yaml":
        kinds = [(c["kind"], c["metadata"]["name"]) for c in children]
        assert ("HorizontalPodAutoscaler", "llama-8b-prefill") in kinds
        assert ("HorizontalPodAutoscaler", "llama-8b-decode") in kinds
        pools = {p.role: p for p in spec.pools}
        assert (pools["prefill"].replicas, pools["decode"].replicas) == (2, 4)
        assert pools["prefill"].autoscaling and pools["prefill"].autoscaling.min_replicas == 2
        assert pools["decode"].autoscaling and pools["decode"].autoscaling.min_replicas == 4


def test_a_shared_model_cache_builds_valid_children() -> None:
    """The disaggregated example with its commented `cache` claim switched on: every engine pod
    mounts the claim, and every child passes strict validation."""
    (isvc,) = documents(MANIFESTS / "examples" / "disaggregated.yaml")
    isvc["metadata"]["uid"] = "00000000-0000-0000-0000-000000000001"
    isvc["spec"]["model"]["cache"] = {"claimName": "model-cache"}
    children = desired_children(isvc, parse_spec(isvc["spec"]))
    for child in children:
        validate(child)
    engines = [
        c for c in children if c["kind"] == "Deployment" and "-router" not in c["metadata"]["name"]
    ]
    assert len(engines) == 2
    for deployment in engines:
        volumes = deployment["spec"]["template"]["spec"]["volumes"]
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "model-cache"}} in volumes


def test_operator_role_covers_what_the_operator_does() -> None:
    """The operator's ClusterRole allows managing every kind of child, reading the custom
    resource, patching its status, posting Events, and holding what router Roles grant."""
    role = next(
        d
        for d in documents(MANIFESTS / "rbac.yaml")
        if d["metadata"]["name"] == "baton-operator" and d["kind"] == "ClusterRole"
    )
    allowed = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    for kind, api_version in CHILD_KINDS.items():
        group, plural = api_version.rpartition("/")[0], PLURALS[kind]
        for verb in ("get", "list", "watch", "create", "patch", "delete"):
            assert (group, plural, verb) in allowed, (group, plural, verb)
    for verb in ("get", "list", "watch"):
        assert (crd.GROUP, crd.PLURAL, verb) in allowed
        assert ("discovery.k8s.io", "endpointslices", verb) in allowed
    assert (crd.GROUP, f"{crd.PLURAL}/status", "patch") in allowed
    assert ("", "events", "create") in allowed
    assert not any(verb in {"*", "escalate", "bind"} for _, _, verb in allowed)
