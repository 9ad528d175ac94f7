"""The Helm chart: `helm lint` passes, and what `helm template` renders with the default and
the all-features values passes kubernetes-validate in strict mode. Skipped without `helm`
(CI puts it on PATH with ../shared/tools/get-helm.sh)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from baton.operator.cli import add_args

CHART = Path(__file__).resolve().parents[2] / "charts" / "baton"
HELM = shutil.which("helm")
pytestmark = pytest.mark.skipif(
    HELM is None, reason='helm not on PATH (export PATH="$(../shared/tools/get-helm.sh):$PATH")'
)
VALUES = [None, CHART / "ci" / "all-features-values.yaml"]


def helm(*args: str) -> str:
    assert HELM is not None
    result = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.parametrize("values", VALUES, ids=["defaults", "all-features"])
def test_helm_lint(values: Path | None) -> None:
    """helm lint finds no errors."""
    helm("lint", "--strict", str(CHART), *(["-f", str(values)] if values else []))


@pytest.mark.parametrize("values", VALUES, ids=["defaults", "all-features"])
def test_rendered_chart_passes_strict_validation(values: Path | None) -> None:
    """Every object the chart renders (CRD included) passes strict validation."""
    rendered = helm(
        "template",
        "baton",
        str(CHART),
        "--namespace",
        "baton-system",
        "--include-crds",
        *(["-f", str(values)] if values else []),
    )
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "Deployment", "ClusterRole", "ServiceAccount"} <= kinds
    if values is not None:
        assert {"ConfigMap", "Service"} <= kinds  # prometheus-adapter rules and the gateway
        assert {"PodMonitor", "PrometheusRule"} <= kinds
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # the Prometheus Operator's kinds have no schema here: test_observability
        kubernetes_validate.validate(doc, "1.34.0", strict=True)


def test_chart_rbac_matches_the_manifests() -> None:
    """The chart grants the operator and the gateway exactly the rules of manifests/rbac.yaml."""
    rendered = helm("template", "baton", str(CHART), "--set", "gateway.enabled=true")
    chart = {
        d["metadata"]["name"].removeprefix("baton-"): d["rules"]
        for d in yaml.safe_load_all(rendered)
        if d and d["kind"] == "ClusterRole"
    }
    manifests = CHART.parents[1] / "manifests" / "rbac.yaml"
    plain = {
        d["metadata"]["name"].removeprefix("baton-"): d["rules"]
        for d in yaml.safe_load_all(manifests.read_text())
        if d and d["kind"] == "ClusterRole"
    }
    assert chart == plain


def test_watched_namespaces_get_namespaced_rbac() -> None:
    """With operator.watchNamespaces the operator gets a Role and RoleBinding in each of them
    and no cluster-wide grant; without, a ClusterRole and ClusterRoleBinding."""
    rendered = helm("template", "baton", str(CHART), "--set", "operator.watchNamespaces={a,b}")
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    grants = {(d["kind"], d["metadata"].get("namespace")) for d in docs if "Role" in d["kind"]}
    assert grants == {("Role", "a"), ("Role", "b"), ("RoleBinding", "a"), ("RoleBinding", "b")}
    for doc in docs:
        kubernetes_validate.validate(doc, "1.34.0", strict=True)
    everywhere = [d for d in yaml.safe_load_all(helm("template", "baton", str(CHART))) if d]
    kinds = {d["kind"] for d in everywhere if "Role" in d["kind"]}
    assert kinds == {"ClusterRole", "ClusterRoleBinding"}


@pytest.mark.parametrize("watch", [None, "operator.watchNamespaces={a,b}"], ids=["all", "some"])
def test_the_operator_may_read_and_create_secrets_but_not_list_them(watch: str | None) -> None:
    """The ClusterRole, or each watched namespace's Role, lets the operator get and create
    Secrets (the hand-off Secret it makes once) and nothing more: no list or watch, which
    would hand it every Secret's value, and no patch, as it never writes one again."""
    rendered = helm("template", "baton", str(CHART), *(["--set", watch] if watch else []))
    grants = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in ("Role", "ClusterRole")]
    assert grants
    for grant in grants:
        secrets = [
            r for r in grant["rules"] if "" in r["apiGroups"] and "secrets" in r["resources"]
        ]
        assert [(r["resources"], r["verbs"]) for r in secrets] == [(["secrets"], ["get", "create"])]


def operator_args(*sets: str) -> list[str]:
    rendered = helm("template", "baton", str(CHART), *(a for s in sets for a in ("--set", s)))
    docs = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Deployment"]
    operator = next(d for d in docs if d["metadata"]["name"] == "baton-operator")
    (container,) = operator["spec"]["template"]["spec"]["containers"]
    return list(container["args"])


def test_the_operator_knows_its_namespace_the_gateway_url_and_the_canary() -> None:
    """The operator is told its own namespace (its pods get into the engines' NetworkPolicy for
    the KV canary), the gateway's URL only when the chart installs the gateway, and how often
    the canary runs; the flags parse."""
    plain = operator_args()
    assert "--operator-namespace=default" in plain and "--kv-canary-seconds=60" in plain
    assert not [a for a in plain if a.startswith("--gateway-url")]
    with_gateway = operator_args("gateway.enabled=true", "gateway.service.port=8080")
    assert "--gateway-url=http://baton-gateway.default.svc:8080" in with_gateway
    assert "--gateway-url=http://baton-gateway.default.svc" in operator_args("gateway.enabled=true")
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(with_gateway[with_gateway.index("operator") + 1 :])
    assert args.gateway_url == "http://baton-gateway.default.svc:8080"
    assert (args.operator_namespace, args.kv_canary_seconds) == ("default", 60.0)


def test_gpu_pools_default_to_the_charts_cuda_image() -> None:
    """The operator's GPU image is the chart's image with -cuda after the tag (the Dockerfile's
    cuda target) unless operator.defaultGpuImage names another."""
    args = operator_args("image.tag=9.9")
    assert "--default-image=baton:9.9" in args and "--default-gpu-image=baton:9.9-cuda" in args
    assert "--default-gpu-image=mine:gpu" in operator_args("operator.defaultGpuImage=mine:gpu")
