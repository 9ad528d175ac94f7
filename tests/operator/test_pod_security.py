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
    "hf-shared-cache": {
        "model": {"uri": "hf://acme/llama-8b", "cache": {"claimName": "hub-cache"}},
        "image": "baton:1",
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
    """Engine and router containers all pass restricted and have a read-only root; engine pods
    mount no service account token and run no init container."""
    built = templates(SPECS[name])
    assert built
    for deployment, template in built.items():
        pod = template["spec"]
        assert violations(pod) == [], deployment
        assert annotation_violations(template["metadata"]) == []
        if not deployment.endswith("-router"):
            assert pod["automountServiceAccountToken"] is False
            assert "initContainers" not in pod


@pytest.mark.parametrize("name", ["hf-disaggregated-tp2", "hf-shared-cache"])
def test_every_writable_path_is_an_empty_dir_or_the_cache_claim(name: str) -> None:
    """Each cache the code writes (its tempfiles, $BATON_CACHE_DIR's model and kernels,
    Triton's kernels, Hugging Face's) points into an emptyDir mount, as does /tmp; an hf://
    model's download directory is under a read-write /models that is an emptyDir, or the
    spec's cache claim, which is the only claim a pod writes to; the pod's fsGroup lets the
    non-root user write there."""
    claim = SPECS[name]["model"].get("cache", {}).get("claimName")
    for deployment, template in templates(SPECS[name]).items():
        pod = template["spec"]
        empty = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        claims = {
            v["name"]: v["persistentVolumeClaim"]
            for v in pod["volumes"]
            if "persistentVolumeClaim" in v
        }
        for container in pod["containers"]:
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            writable = [p for p, m in mounts.items() if not m.get("readOnly")]
            assert all(mounts[p]["name"] in empty | set(claims) for p in writable)
            for volume in {mounts[p]["name"] for p in writable} & set(claims):
                assert claims[volume] == {"claimName": claim}, deployment
            assert "/tmp" in writable, container["name"]
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            for var in ("BATON_CACHE_DIR", "TRITON_CACHE_DIR", "HF_HOME", "XDG_CACHE_HOME"):
                assert any(env[var].startswith(p) for p in writable), (var, env[var])
            if deployment.endswith("-router"):
                assert "/models" not in mounts
                continue
            args = container["args"]
            download = args[args.index("--download-dir") + 1]
            assert download.startswith("/models/") and "/models" in writable
            assert ("emptyDir" in next(v for v in pod["volumes"] if v["name"] == "model")) == (
                claim is None
            )
            assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]


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
