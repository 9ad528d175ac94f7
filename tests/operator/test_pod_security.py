"""Every pod template the operator builds, and every pod the manifests and the chart ship,
passes Pod Security "restricted" (the checker in pod_security.py) with a read-only root and
writable scratch wherever the code writes; engine pods get no service account token."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from baton.operator.resources import desired_children
from baton.operator.spec import parse_spec
from tests.operator.pod_security import annotation_violations, violations

ROOT = Path(__file__).resolve().parents[2]
ISVC = {"metadata": {"name": "llama", "namespace": "serving", "uid": "uid-1"}}
SPECS: dict[str, dict[str, Any]] = {
    "hf-disaggregated-tp2": {
        "model": {"uri": "hf://acme/llama-8b", "hfTokenSecret": {"name": "hf"}},
        "image": "baton:1",
        "engine": {"tensorParallelSize": 2},
        "apiKeySecret": {"name": "keys"},
    },
    "pvc-aggregated": {
        "model": {"uri": "pvc://weights/llama"},
        "image": "baton:1",
        "mode": "aggregated",
    },
    "file-autoscaled": {
        "model": {"uri": "file:///opt/llama"},
        "image": "baton:1",
        "decode": {"autoscaling": {"maxReplicas": 4}},
    },
}


def templates(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    children = desired_children(ISVC, parse_spec(spec))
    return {
        c["metadata"]["name"]: c["spec"]["template"] for c in children if c["kind"] == "Deployment"
    }


def test_the_checker_catches_what_restricted_forbids() -> None:
    """A default pod spec, and one with each restricted field undone, fail the checker."""
    bare = {"containers": [{"name": "c", "image": "x"}], "volumes": [{"name": "h", "hostPath": {}}]}
    found = " ".join(violations(bare))
    for fragment in ("allowPrivilegeEscalation", "runAsNonRoot", "seccomp", "ALL", "hostPath"):
        assert fragment in found


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_generated_template_is_restricted(name: str) -> None:
    """Engine, model-fetch and router containers all pass restricted and have a read-only
    root; engine pods mount no service account token."""
    built = templates(SPECS[name])
    assert built
    for deployment, template in built.items():
        pod = template["spec"]
        assert violations(pod) == [], deployment
        assert annotation_violations(template["metadata"]) == []
        if not deployment.endswith("-router"):
            assert pod["automountServiceAccountToken"] is False


def test_every_writable_path_is_an_empty_dir() -> None:
    """Each cache the code writes (its tempfiles, $BATON_CACHE_DIR's model and kernels,
    Triton's kernels, Hugging Face's) points into an emptyDir mount, as does /tmp."""
    for template in templates(SPECS["hf-disaggregated-tp2"]).values():
        pod = template["spec"]
        empty = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for container in pod["containers"] + pod.get("initContainers", []):
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            writable = [path for path, volume in mounts.items() if volume in empty]
            assert "/tmp" in writable, container["name"]
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            for var in ("BATON_CACHE_DIR", "TRITON_CACHE_DIR", "HF_HOME", "XDG_CACHE_HOME"):
                if var in env:
                    assert any(env[var].startswith(p) for p in writable), (var, env[var])
            if container["name"] != "fetch-model":
                assert {"BATON_CACHE_DIR", "TRITON_CACHE_DIR", "HF_HOME"} <= set(env)


def _pods(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (d["metadata"]["name"], d["spec"]["template"])
        for d in docs
        if d and d.get("kind") == "Deployment"
    ]


@pytest.mark.parametrize("name", ["operator.yaml", "gateway.yaml"])
def test_shipped_manifests_are_restricted(name: str) -> None:
    """The operator's and the gateway's Deployments in manifests/ pass restricted."""
    pods = _pods(list(yaml.safe_load_all((ROOT / "manifests" / name).read_text())))
    assert pods
    for deployment, template in pods:
        assert violations(template["spec"]) == [], deployment


@pytest.mark.skipif(shutil.which("helm") is None, reason="helm not on PATH")
def test_chart_pods_are_restricted() -> None:
    """The chart's operator and gateway pods pass restricted."""
    rendered = subprocess.run(
        [
            "helm",
            "template",
            "baton",
            str(ROOT / "charts" / "baton"),
            "--set",
            "gateway.enabled=true",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    pods = _pods(list(yaml.safe_load_all(rendered)))
    assert {name for name, _ in pods} == {"baton-operator", "baton-gateway"}
    for deployment, template in pods:
        assert violations(template["spec"]) == [], deployment
