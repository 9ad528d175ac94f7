"""A kubeconfig whose user authenticates through an exec credential plugin, as on EKS, GKE and
AKS, against an API server that checks bearer tokens: `baton operator` (a kopf process) and the
router's Kubernetes discovery both work with the plugin's token, and a wrong token is refused."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from baton.router.discovery import Endpoint
from baton.router.k8s_discovery import KubernetesDiscovery
from tests.operator.conftest import Kube, emulated, wait_for
from tests.router.test_k8s_discovery import discover, publish, service
from tests.support.exec_credential import exec_user, runs

pytestmark = pytest.mark.slow

NS = "serving"
TOKEN = "issued-by-plugin"
SPEC = {"model": {"uri": "hf://acme/llama-8b"}, "image": "baton:1"}


@pytest.fixture()
def kube() -> Iterator[Kube]:
    """Overrides conftest's server: this one accepts only the plugin's token."""
    with emulated(token=TOKEN) as client:
        yield client


def plugin_kubeconfig(kube: Kube, folder: Path, token: str) -> Path:
    folder.mkdir(exist_ok=True)
    return kube.server.write_kubeconfig(
        folder / "kubeconfig", namespace=NS, user=exec_user(folder, token)
    )


def test_operator_logs_in_through_the_exec_plugin(
    kube: Kube, start_operator: Callable[..., Any], tmp_path: Path
) -> None:
    """kopf's watches and the reconciler's calls carry the plugin's token: a service applied
    gets its children, and the server refused nothing."""
    kubeconfig = plugin_kubeconfig(kube, tmp_path / "plugin", TOKEN)
    operator = start_operator(kubeconfig=kubeconfig)  # its namespace: the kubeconfig context's
    kube.apply_isvc(NS, "llama", SPEC)
    wanted = {"llama-prefill", "llama-decode", "llama-router"}
    wait_for(lambda: wanted <= kube.names("deployments", NS), what="children")
    wait_for(lambda: (kube.isvc(NS, "llama") or {}).get("status"), what="status")
    assert runs(tmp_path / "plugin") >= 1
    assert kube.server.handler.refused == 0
    # The operator never imports torch (layering): no libtorch in the running process.
    assert "libtorch" not in Path(f"/proc/{operator.pid}/maps").read_text()


def test_router_discovery_logs_in_through_the_exec_plugin(kube: Kube, tmp_path: Path) -> None:
    """The router's EndpointSlice discovery connects with the plugin's token."""
    publish(kube.server, service(NS, "llama", "both", "llama"), {"10.0.0.1": True})
    kubeconfig = plugin_kubeconfig(kube, tmp_path / "plugin", TOKEN)
    final = discover(str(kubeconfig), NS, lambda eps: len(eps) == 1)[-1]
    assert final == {Endpoint("http://10.0.0.1:8000", "both", "llama")}
    assert kube.server.handler.refused == 0


def test_a_wrong_token_is_refused(
    kube: Kube, start_operator: Callable[..., Any], tmp_path: Path
) -> None:
    """With a plugin that prints another token, the server answers 401: the operator creates
    nothing and the router's discovery publishes no engine."""
    kube.apply_isvc(NS, "llama", SPEC)
    publish(kube.server, service(NS, "llama", "both", "llama"), {"10.0.0.1": True})
    kubeconfig = plugin_kubeconfig(kube, tmp_path / "plugin", "stolen")
    start_operator(kubeconfig=kubeconfig)
    wait_for(lambda: kube.server.handler.refused >= 1, what="the operator's refused calls")
    refused = kube.server.handler.refused
    published: list[frozenset[Endpoint]] = []

    async def main() -> None:
        selector = {"app.kubernetes.io/name": "baton"}
        discovery = KubernetesDiscovery(NS, selector, kubeconfig=str(kubeconfig))
        task = asyncio.create_task(discovery.run(published.append))
        await asyncio.sleep(2)
        task.cancel()
        gc.collect()  # closes the plugin's finished subprocesses while this loop still runs

    asyncio.run(main())
    assert published == []
    assert kube.server.handler.refused > refused  # discovery was turned away too
    time.sleep(1)  # time for a stray write to land
    assert kube.names("deployments", NS) == set()
    assert "status" not in (kube.isvc(NS, "llama") or {})
