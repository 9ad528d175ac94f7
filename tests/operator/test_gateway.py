"""The cluster-wide endpoint: with services in two namespaces, the gateway's discovery (labels
`app.kubernetes.io/name=baton`, every namespace) finds the engines of both models."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.operator.conftest import Kube, wait_for
from tests.router.test_k8s_discovery import discover
from tests.support.kmock_server import endpoint_slice

pytestmark = pytest.mark.slow


def test_gateway_discovers_every_model(
    kube: Kube, start_operator: Callable[..., Any], tmp_path: Any
) -> None:
    """Engines of an aggregated and a disaggregated service in two namespaces are found with
    their roles and served models; routers are not mistaken for engines."""
    start_operator("--all-namespaces")
    kube.apply_isvc(
        "team-a",
        "llama",
        {"model": {"uri": "hf://acme/llama"}, "image": "baton:1", "mode": "aggregated"},
    )
    kube.apply_isvc(
        "team-b", "qwen", {"model": {"uri": "pvc://weights/qwen-7b"}, "image": "baton:1"}
    )
    # Engine Services and the routers' Services, which match the gateway's selector too.
    wanted = {
        ("team-a", "llama-engine"),
        ("team-a", "llama"),
        ("team-b", "qwen-prefill"),
        ("team-b", "qwen-decode"),
        ("team-b", "qwen"),
    }

    def services() -> list[dict[str, Any]]:
        found = list(kube.server.objects("services"))
        keys = {(s["metadata"]["namespace"], s["metadata"]["name"]) for s in found}
        return found if wanted <= keys else []

    address = iter(f"10.1.0.{i}" for i in range(1, 100))
    with httpx.Client(base_url=kube.server.url) as http:
        for svc in wait_for(services, what="headless Services"):
            ns = svc["metadata"]["namespace"]
            slice_ = endpoint_slice(svc, {next(address): True})
            path = f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
            assert http.post(path, json=slice_).status_code == 201

    kubeconfig = str(kube.server.write_kubeconfig(tmp_path / "gateway-kubeconfig"))
    final = discover(kubeconfig, None, lambda eps: len(eps) == 3)[-1]
    assert {(e.model, e.role) for e in final} == {
        ("acme/llama", "both"),
        ("qwen-7b", "prefill"),
        ("qwen-7b", "decode"),
    }
