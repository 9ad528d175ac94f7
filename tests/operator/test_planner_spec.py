"""`spec.planner`: parsed into `PlannerSpec` with the CRD's defaults, refused where the planner
cannot own the pools' size, and, when on, no HPA, no ScaledObject and no replicas applied to
either engine pool, with the replicas that ran handed over rather than reset."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from baton.kube import connect
from baton.operator.api import Api
from baton.operator.reconciler import Reconciler, owns
from baton.operator.resources import MANAGER, desired_children
from baton.operator.spec import PlannerSpec, parse_spec
from baton.operator.validation import SpecError
from tests.operator.conftest import Kube

NS = "serving"
ISVC = f"/apis/baton.dev/v1alpha1/namespaces/{NS}/inferenceservices/llama"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
META = {"name": "llama", "namespace": NS, "uid": "uid-1"}
SPEC: dict[str, Any] = {"model": {"uri": "hf://acme/llama-8b"}, "image": "b:1"}
PLANNER: dict[str, Any] = {
    "ttftSeconds": 0.5,
    "itlSeconds": 0.05,
    "prefill": {"maxReplicas": 4},
    "decode": {"minReplicas": 2, "maxReplicas": 8},
}


def test_the_planner_is_parsed_with_the_crds_defaults() -> None:
    """Present means enabled; interval 30 s, cool-down 120 s and minReplicas 1 by default;
    integers where seconds may be fractions become floats."""
    planner = parse_spec(SPEC | {"planner": PLANNER | {"ttftSeconds": 2}}).planner
    assert planner == PlannerSpec(
        ttft_seconds=2.0,
        itl_seconds=0.05,
        interval_seconds=30,
        cooldown_seconds=120,
        prefill_min=1,
        prefill_max=4,
        decode_min=2,
        decode_max=8,
    )
    assert isinstance(planner.ttft_seconds, float)
    given = PLANNER | {"intervalSeconds": 10, "cooldownSeconds": 0, "enabled": True}
    planner = parse_spec(SPEC | {"planner": given}).planner
    assert planner is not None and (planner.interval_seconds, planner.cooldown_seconds) == (10, 0)


def test_no_planner_or_a_disabled_one_is_none() -> None:
    """Without spec.planner, or with enabled: false, there is no planner, and the pools' own
    replicas and autoscaling stand (a disabled planner does not forbid autoscaling)."""
    assert parse_spec(SPEC).planner is None
    off = SPEC | {
        "planner": PLANNER | {"enabled": False},
        "decode": {"autoscaling": {"maxReplicas": 3}},
    }
    spec = parse_spec(off)
    assert spec.planner is None and spec.pools[1].autoscaling is not None


@pytest.mark.parametrize(
    ("change", "reason", "fragment"),
    [
        ({"mode": "aggregated"}, "InvalidPlanner", "set mode: disaggregated"),
        (
            {"prefill": {"autoscaling": {"maxReplicas": 3}}},
            "InvalidPlanner",
            "spec.prefill.autoscaling",
        ),
        (
            {"decode": {"autoscaling": {"engine": "keda", "minReplicas": 0, "maxReplicas": 3}}},
            "InvalidPlanner",
            "remove spec.decode.autoscaling",
        ),
        (
            {"planner": PLANNER | {"decode": {"minReplicas": 5, "maxReplicas": 2}}},
            "InvalidPlanner",
            "decode.minReplicas 5 is above",
        ),
        (
            {"planner": {k: v for k, v in PLANNER.items() if k != "ttftSeconds"}},
            "InvalidSpec",
            "ttftSeconds is required",
        ),
        ({"planner": PLANNER | {"itlSeconds": 0}}, "InvalidSpec", "itlSeconds must be above 0"),
        ({"planner": PLANNER | {"ttftSeconds": "1s"}}, "InvalidSpec", "must be a number"),
        ({"planner": PLANNER | {"ttftSeconds": True}}, "InvalidSpec", "must be a number"),
        ({"planner": PLANNER | {"prefill": {}}}, "InvalidSpec", "prefill.maxReplicas is required"),
        (
            {"planner": PLANNER | {"prefill": {"minReplicas": 0, "maxReplicas": 2}}},
            "InvalidSpec",
            "at least 1",
        ),
        (
            {"planner": PLANNER | {"intervalSeconds": 0}},
            "InvalidSpec",
            "intervalSeconds must be at least 1",
        ),
    ],
)
def test_a_planner_that_cannot_work_is_refused(
    change: dict[str, Any], reason: str, fragment: str
) -> None:
    """The planner needs a disaggregated service and the pools' size to itself; its fields
    follow the CRD schema; each refusal names what to change."""
    with pytest.raises(SpecError) as info:
        parse_spec(SPEC | {"planner": PLANNER} | change)
    assert info.value.reason == reason
    assert fragment in info.value.message


def test_the_planner_owns_both_pools_size() -> None:
    """With the planner on, neither engine Deployment carries replicas (even those the pools
    name), there is no HPA or ScaledObject, and the router keeps its replicas."""
    spec = SPEC | {"planner": PLANNER, "prefill": {"replicas": 3}, "decode": {"replicas": 5}}
    children = desired_children({"metadata": META, "spec": spec}, parse_spec(spec))
    kinds = {c["kind"] for c in children}
    assert not kinds & {"HorizontalPodAutoscaler", "ScaledObject"}
    replicas = {
        c["metadata"]["name"]: c["spec"].get("replicas")
        for c in children
        if c["kind"] == "Deployment"
    }
    assert replicas == {"llama-prefill": None, "llama-decode": None, "llama-router": 1}
    without = desired_children({"metadata": META, "spec": SPEC}, parse_spec(SPEC))
    assert {c["spec"].get("replicas") for c in without if c["kind"] == "Deployment"} == {1}


def test_turning_the_planner_on_hands_replicas_over(kube: Kube, tmp_path: Path) -> None:
    """An autoscaled service turned over to the planner (autoscaling removed in the same edit)
    loses its HPA, keeps the replicas that ran instead of falling back to one, and what the
    planner then writes stays through later passes."""
    kube.apply_isvc(
        NS,
        "llama",
        SPEC
        | {
            "prefill": {"replicas": 2},
            "decode": {"replicas": 3, "autoscaling": {"maxReplicas": 6}},
        },
    )
    prefill, decode = f"{DEPLOYMENTS}/llama-prefill", f"{DEPLOYMENTS}/llama-decode"

    def replicas(path: str) -> int:
        return int((kube.get(path) or {})["spec"]["replicas"])

    async def main() -> None:
        cluster = await connect(str(kube.server.write_kubeconfig(tmp_path / "kubeconfig")))
        try:
            reconciler = Reconciler(Api(cluster))
            await reconciler.reconcile(NS, "llama")
            assert kube.names("horizontalpodautoscalers", NS) == {"llama-decode"}
            kube.patch(decode, {"spec": {"replicas": 4}})  # as the HPA would
            kube.patch(ISVC, {"spec": {"planner": PLANNER, "decode": {"autoscaling": None}}})
            await reconciler.reconcile(NS, "llama")
            assert kube.names("horizontalpodautoscalers", NS) == set()
            assert (replicas(prefill), replicas(decode)) == (2, 4)
            assert not owns(kube.get(prefill) or {}, MANAGER, ("f:spec", "f:replicas"))
            kube.patch(prefill, {"spec": {"replicas": 3}})  # as the planner would
            await reconciler.reconcile(NS, "llama")
            await Reconciler(reconciler.api).reconcile(NS, "llama")  # a restarted operator
        finally:
            await cluster.close()

    asyncio.run(main())
    assert (replicas(prefill), replicas(decode)) == (3, 4)
