"""Children by server-side apply, one reconcile pass at a time against the emulated API server:
no writes when nothing changed, hand edits taken back, fields the operator stopped setting
removed, other managers' fields kept, replicas handed to an HPA, names taken by others refused."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.dynamic.exceptions import ConflictError

from baton.kube import connect
from baton.operator.api import Api
from baton.operator.reconciler import ChildConflict, Reconciler, contains, owns
from baton.operator.resources import MANAGER
from tests.operator.conftest import Kube

NS = "serving"
ISVC = f"/apis/baton.dev/v1alpha1/namespaces/{NS}/inferenceservices/llama"
PREFILL = f"/apis/apps/v1/namespaces/{NS}/deployments/llama-prefill"
SPEC: dict[str, Any] = {"model": {"uri": "hf://acme/llama-8b"}, "image": "b:1"}


def run(kube: Kube, tmp_path: Path, body: Callable[[Reconciler], Awaitable[None]]) -> None:
    """Runs `body` with a reconciler connected to `kube` (through a kubeconfig, as the operator
    connects)."""

    async def main() -> None:
        cluster = await connect(str(kube.server.write_kubeconfig(tmp_path / "kubeconfig")))
        try:
            await body(Reconciler(Api(cluster)))
        finally:
            await cluster.close()

    asyncio.run(main())


def prefill(kube: Kube) -> dict[str, Any]:
    deployment = kube.get(PREFILL)
    assert deployment is not None
    return deployment


def engine_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def test_an_unchanged_service_causes_no_writes(kube: Kube, tmp_path: Path) -> None:
    """A second pass writes nothing, and neither does a restarted operator, whose first pass
    applies every child again: an apply that changes nothing is no write."""
    kube.apply_isvc(NS, "llama", SPEC)

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")
        revision = kube.server.handler.revision
        await reconciler.reconcile(NS, "llama")
        assert kube.server.handler.revision == revision
        restarted = Reconciler(reconciler.api)
        await restarted.reconcile(NS, "llama")
        assert kube.server.handler.revision == revision

    run(kube, tmp_path, body)
    managers = [(e["manager"], e["operation"]) for e in prefill(kube)["metadata"]["managedFields"]]
    assert managers == [(MANAGER, "Apply")]


def test_hand_edits_are_taken_back(kube: Kube, tmp_path: Path) -> None:
    """An image edited by hand, and a desired label removed, are put back on the next pass."""
    kube.apply_isvc(NS, "llama", SPEC)

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")
        template = {"spec": {"containers": [{"name": "engine", "image": "evil:1"}]}}
        kube.patch(PREFILL, {"spec": {"template": template}})
        kube.patch(PREFILL, {"metadata": {"labels": {"baton.dev/role": None}}})
        await reconciler.reconcile(NS, "llama")

    run(kube, tmp_path, body)
    deployment = prefill(kube)
    assert engine_container(deployment)["image"] == "b:1"
    assert deployment["metadata"]["labels"]["baton.dev/role"] == "prefill"


def test_fields_no_longer_set_are_removed(kube: Kube, tmp_path: Path) -> None:
    """A field the spec stops asking for (a node selector) leaves the child, which no
    last-applied annotation records any more."""
    kube.apply_isvc(NS, "llama", SPEC | {"prefill": {"nodeSelector": {"gpu": "h100"}}})

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")
        assert prefill(kube)["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "h100"}
        kube.patch(ISVC, {"spec": {"prefill": {"nodeSelector": None}}})
        await reconciler.reconcile(NS, "llama")

    run(kube, tmp_path, body)
    deployment = prefill(kube)
    assert "nodeSelector" not in deployment["spec"]["template"]["spec"]
    assert "baton.dev/last-applied" not in (deployment["metadata"].get("annotations") or {})


def test_fields_of_other_managers_are_kept(kube: Kube, tmp_path: Path) -> None:
    """What another controller applies to a child (an env var injected into the engine
    container) survives the operator's forced applies: lists of named items merge by name."""
    kube.apply_isvc(NS, "llama", SPEC)

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")
        env = [{"name": "X", "value": "1"}]
        injected = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "llama-prefill", "namespace": NS},
            "spec": {"template": {"spec": {"containers": [{"name": "engine", "env": env}]}}},
        }
        await reconciler.api.apply(injected, "injector", force=False)
        await Reconciler(reconciler.api).reconcile(NS, "llama")  # applies everything again

    run(kube, tmp_path, body)
    container = engine_container(prefill(kube))
    assert {"name": "X", "value": "1"} in container["env"]
    assert container["image"] == "b:1" and "--role" in container["args"]


def test_conflicts_need_force(kube: Kube, tmp_path: Path) -> None:
    """Applying a value that another manager owns fails without force; with force the applier
    takes the field over."""
    kube.apply_isvc(NS, "llama", SPEC)
    theirs = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "llama-prefill", "namespace": NS},
        "spec": {"replicas": 9},
    }

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")
        with pytest.raises(ConflictError, match="replicas"):
            await reconciler.api.apply(theirs, "someone", force=False)
        assert prefill(kube)["spec"]["replicas"] == 1
        await reconciler.api.apply(theirs, "someone", force=True)

    run(kube, tmp_path, body)
    deployment = prefill(kube)
    assert deployment["spec"]["replicas"] == 9
    assert owns(deployment, "someone", ("f:spec", "f:replicas"))
    assert not owns(deployment, MANAGER, ("f:spec", "f:replicas"))


def test_replicas_handed_to_the_hpa_are_left_alone(kube: Kube, tmp_path: Path) -> None:
    """Turning autoscaling on stops setting replicas without resetting them before the HPA
    writes them, and what the HPA then chooses stays."""
    kube.apply_isvc(NS, "llama", SPEC | {"prefill": {"replicas": 2}})

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")
        assert owns(prefill(kube), MANAGER, ("f:spec", "f:replicas"))
        autoscaling = {"autoscaling": {"minReplicas": 1, "maxReplicas": 8}}
        kube.patch(ISVC, {"spec": {"prefill": autoscaling}})
        await reconciler.reconcile(NS, "llama")
        deployment = prefill(kube)
        assert deployment["spec"]["replicas"] == 2
        assert not owns(deployment, MANAGER, ("f:spec", "f:replicas"))
        assert kube.names("horizontalpodautoscalers", NS) == {"llama-prefill"}
        kube.patch(PREFILL, {"spec": {"replicas": 7}})  # as the HPA would
        await reconciler.reconcile(NS, "llama")
        await Reconciler(reconciler.api).reconcile(NS, "llama")

    run(kube, tmp_path, body)
    assert prefill(kube)["spec"]["replicas"] == 7


def test_a_name_taken_by_another_object_is_refused(kube: Kube, tmp_path: Path) -> None:
    """A Service that the InferenceService does not control keeps its fields; the service gets
    Ready=False with reason ChildConflict."""
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "llama"}, "spec": {}}
    assert kube.http.post(f"/api/v1/namespaces/{NS}/services", json=service).status_code == 201
    kube.apply_isvc(NS, "llama", SPEC)

    async def body(reconciler: Reconciler) -> None:
        with pytest.raises(ChildConflict):
            await reconciler.reconcile(NS, "llama")

    run(kube, tmp_path, body)
    foreign = kube.get(f"/api/v1/namespaces/{NS}/services/llama")
    assert foreign is not None and "ownerReferences" not in foreign["metadata"]
    isvc = kube.isvc(NS, "llama")
    assert isvc is not None
    ready = [c for c in isvc["status"]["conditions"] if c["type"] == "Ready"]
    assert ready[0]["status"] == "False" and ready[0]["reason"] == "ChildConflict"


def test_contains_treats_quantities_the_server_normalised_as_equal() -> None:
    """An integer quantity the server returns as a string is not drift; other types are."""
    assert contains({"limits": {"nvidia.com/gpu": "2"}}, {"limits": {"nvidia.com/gpu": 2}})
    assert not contains({"a": [1, 2]}, {"a": [1]})
    assert not contains({"a": "true"}, {"a": True})
