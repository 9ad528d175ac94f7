"""The operator as a separate process against the emulated API server: apply, update, repair,
status, bad specs and deletion."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.operator.conftest import Kube, wait_for

pytestmark = pytest.mark.slow

NS = "serving"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
SERVICES = f"/api/v1/namespaces/{NS}/services"


def disaggregated(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"uri": "hf://acme/llama-8b", "servedModelName": "llama"},
        "image": "baton:1",
        "prefill": {"replicas": 2},
        "decode": {"autoscaling": {"minReplicas": 4, "maxReplicas": 8}},
    }
    return spec | overrides


def children_present(kube: Kube) -> bool:
    return {"llama-prefill", "llama-decode", "llama-router"} <= kube.names("deployments", NS)


def ready(kube: Kube) -> dict[str, Any] | None:
    isvc = kube.isvc(NS, "llama") or {}
    for cond in isvc.get("status", {}).get("conditions", []):
        if cond["type"] == "Ready":
            return cond  # type: ignore[no-any-return]
    return None


def rollout_done(kube: Kube) -> bool:
    isvc = kube.isvc(NS, "llama") or {}
    conditions = isvc.get("status", {}).get("conditions", [])
    return any(c["type"] == "RolloutComplete" and c["status"] == "True" for c in conditions)


def test_apply_creates_every_child_with_owner_references(
    kube: Kube, start_operator: Callable[..., Any]
) -> None:
    """Applying a service creates its Deployments, Services, HPA, PDBs and RBAC, all owned by it,
    and an unchanged spec then makes no more writes."""
    start_operator("--namespace", NS)
    uid = kube.apply_isvc(NS, "llama", disaggregated())["metadata"]["uid"]
    wait_for(lambda: children_present(kube) and ready(kube), what="children and status")
    assert kube.names("services", NS) == {"llama", "llama-prefill", "llama-decode"}
    assert kube.names("horizontalpodautoscalers", NS) == {"llama-decode"}
    assert kube.names("poddisruptionbudgets", NS) == {
        "llama-prefill",
        "llama-decode",
        "llama-router",
    }
    for plural in ("serviceaccounts", "roles", "rolebindings"):
        assert kube.names(plural, NS) == {"llama-router"}
    for plural in ("deployments", "services", "horizontalpodautoscalers", "roles"):
        for obj in kube.server.objects(plural, NS):
            (owner,) = obj["metadata"]["ownerReferences"]
            assert owner["uid"] == uid and owner["controller"] is True
    prefill = kube.get(f"{DEPLOYMENTS}/llama-prefill")
    decode = kube.get(f"{DEPLOYMENTS}/llama-decode")
    assert prefill is not None and decode is not None
    assert prefill["spec"]["replicas"] == 2
    assert "replicas" not in decode["spec"]  # the HPA owns it
    assert "--role" in (args := prefill["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args[args.index("--role") + 1] == "prefill"
    hpa = kube.get(f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers/llama-decode")
    assert hpa is not None and hpa["spec"]["minReplicas"] == 4
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm:kv_cache_usage_perc"
    headless = kube.get(f"{SERVICES}/llama-decode")
    assert headless is not None and headless["spec"]["clusterIP"] == "None"
    assert headless["metadata"]["annotations"]["baton.dev/served-model-name"] == "llama"

    def quiet_for_half_a_second() -> bool:
        before = kube.server.handler.revision
        time.sleep(0.5)
        return kube.server.handler.revision == before

    # A write loop would never go quiet; once quiet, nothing more is written.
    wait_for(quiet_for_half_a_second, what="the operator to stop writing")
    revision = kube.server.handler.revision
    time.sleep(1.0)
    assert kube.server.handler.revision == revision, "an unchanged spec caused writes"


def test_edits_and_deleted_children_are_repaired(
    kube: Kube, start_operator: Callable[..., Any]
) -> None:
    """Changing replicas or image updates the children; a deleted or hand-edited child comes
    back as the spec says."""
    start_operator("--namespace", NS)
    kube.apply_isvc(NS, "llama", disaggregated())
    wait_for(lambda: children_present(kube), what="children")

    path = f"/apis/baton.dev/v1alpha1/namespaces/{NS}/inferenceservices/llama"
    kube.patch(path, {"spec": {"image": "baton:2", "prefill": {"replicas": 3}}})

    def updated() -> bool:
        prefill = kube.get(f"{DEPLOYMENTS}/llama-prefill") or {}
        router = kube.get(f"{DEPLOYMENTS}/llama-router") or {}
        return (
            prefill["spec"]["replicas"] == 3
            and prefill["spec"]["template"]["spec"]["containers"][0]["image"] == "baton:2"
            and router["spec"]["template"]["spec"]["containers"][0]["image"] == "baton:2"
        )

    wait_for(updated, what="replicas and image updated")

    kube.delete(f"{SERVICES}/llama")
    wait_for(lambda: "llama" in kube.names("services", NS), what="router Service recreated")

    template = {"spec": {"containers": [{"name": "engine", "image": "evil:1"}]}}
    kube.patch(f"{DEPLOYMENTS}/llama-decode", {"spec": {"template": template}})
    wait_for(
        lambda: (kube.get(f"{DEPLOYMENTS}/llama-decode") or {})["spec"]["template"]["spec"][
            "containers"
        ][0].get("args"),
        what="hand-edited Deployment restored",
    )


def test_ready_deployments_make_the_service_ready(
    kube: Kube, start_operator: Callable[..., Any]
) -> None:
    """Deployment status reporting ready pods turns the conditions to Ready=True with the URL,
    and once every pod is updated and available, RolloutComplete=True."""
    start_operator("--namespace", NS)
    kube.apply_isvc(NS, "llama", disaggregated())
    wait_for(lambda: children_present(kube) and ready(kube), what="children")
    first = ready(kube)
    assert first is not None and first["status"] == "False"
    assert first["reason"] == "ComponentsNotReady"

    for name, count in (("llama-prefill", 2), ("llama-decode", 4), ("llama-router", 1)):
        if name == "llama-decode":  # as the HPA would
            kube.patch(f"{DEPLOYMENTS}/{name}", {"spec": {"replicas": 4}})
        generation = (kube.get(f"{DEPLOYMENTS}/{name}") or {})["metadata"]["generation"]
        status = {"readyReplicas": count, "replicas": count, "observedGeneration": generation}
        status |= {"updatedReplicas": count, "availableReplicas": count}
        kube.patch(f"{DEPLOYMENTS}/{name}/status", {"status": status})

    wait_for(lambda: (ready(kube) or {}).get("status") == "True", what="Ready=True")
    wait_for(lambda: rollout_done(kube), what="RolloutComplete=True")
    isvc = kube.isvc(NS, "llama")
    assert isvc is not None
    status = isvc["status"]
    assert status["url"] == f"http://llama.{NS}.svc"
    assert status["prefill"]["summary"] == "2/2" and status["decode"]["summary"] == "4/4"
    assert status["observedGeneration"] == isvc["metadata"]["generation"]
    kinds = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    assert kinds == {
        "Ready": ("True", "AllComponentsReady"),
        "PrefillReady": ("True", "ReplicasReady"),
        "DecodeReady": ("True", "ReplicasReady"),
        "RouterReady": ("True", "ReplicasReady"),
        "RolloutComplete": ("True", "RolloutComplete"),
        "ModelNameConflict": ("False", "ModelNameUnique"),
        # Ready pools, but no EndpointSlices here: the canary finds no engine to hand off with.
        "KVPathReady": kinds["KVPathReady"],
    }
    assert kinds["KVPathReady"] in {("Unknown", "CanaryPending"), ("False", "NoReadyEngines")}


def test_invalid_spec_reports_a_reason_and_an_event(
    kube: Kube, start_operator: Callable[..., Any]
) -> None:
    """A decode tensorParallelSize unlike prefill's gives Ready=False with its reason and a
    Warning Event, creates nothing, and the operator keeps running; fixing it recovers."""
    operator = start_operator("--namespace", NS)
    bad = disaggregated(prefill={"tensorParallelSize": 2}, decode={"tensorParallelSize": 1})
    kube.apply_isvc(NS, "llama", bad)
    cond = wait_for(lambda: ready(kube), what="a Ready condition")
    assert cond["status"] == "False" and cond["reason"] == "TensorParallelMismatch"
    assert "prefill" in cond["message"]
    events = wait_for(lambda: list(kube.server.objects("events", NS)), what="an Event")
    assert events[0]["type"] == "Warning" and events[0]["reason"] == "TensorParallelMismatch"
    assert events[0]["involvedObject"]["name"] == "llama"
    assert kube.names("deployments", NS) == set()
    assert operator.poll() is None

    path = f"/apis/baton.dev/v1alpha1/namespaces/{NS}/inferenceservices/llama"
    kube.patch(path, {"spec": {"decode": {"tensorParallelSize": 2}}})
    wait_for(lambda: children_present(kube), what="children after the fix")


def test_deleting_the_service_removes_its_children(
    kube: Kube, start_operator: Callable[..., Any]
) -> None:
    """Deleting the InferenceService garbage-collects every child, and the operator does not
    bring them back."""
    start_operator("--namespace", NS)
    kube.apply_isvc(NS, "llama", disaggregated())
    wait_for(lambda: children_present(kube), what="children")
    kube.delete(f"/apis/baton.dev/v1alpha1/namespaces/{NS}/inferenceservices/llama")
    wait_for(lambda: not kube.names("deployments", NS), what="children gone")
    time.sleep(0.5)
    for plural in ("deployments", "services", "horizontalpodautoscalers", "roles"):
        assert kube.names(plural, NS) == set(), plural


def test_switching_modes_replaces_the_engine_pools(
    kube: Kube, start_operator: Callable[..., Any]
) -> None:
    """An aggregated service runs one engine pool; switching it to disaggregated replaces that
    pool, its Service and PDB with prefill and decode ones."""
    start_operator("--all-namespaces")
    spec = {"model": {"uri": "file:///models/llama"}, "image": "baton:1", "mode": "aggregated"}
    kube.apply_isvc(NS, "llama", spec)
    wait_for(lambda: kube.names("deployments", NS) == {"llama-engine", "llama-router"})
    engine = kube.get(f"{DEPLOYMENTS}/llama-engine")
    assert engine is not None
    args = engine["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--role") + 1] == "both"

    path = f"/apis/baton.dev/v1alpha1/namespaces/{NS}/inferenceservices/llama"
    kube.patch(path, {"spec": {"mode": "disaggregated"}})
    wait_for(
        lambda: kube.names("deployments", NS) == {"llama-prefill", "llama-decode", "llama-router"},
        what="pools replaced",
    )
    for plural in ("services", "poddisruptionbudgets"):  # pruned one after the other
        wait_for(lambda p=plural: "llama-engine" not in kube.names(p, NS), what=f"{plural} pruned")
