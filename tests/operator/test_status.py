"""Status from the live Deployments: replicas, URL, conditions and their transition times."""

from __future__ import annotations

from typing import Any

from baton.operator.spec import parse_spec
from baton.operator.status import failed_status, merge_conditions, running_status

SPEC = parse_spec({"model": {"uri": "file:///m"}, "image": "b"})


def isvc(status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "s", "namespace": "n", "generation": 4}, "status": status or {}}


def deployment(desired: int, ready: int) -> dict[str, Any]:
    return {"spec": {"replicas": desired}, "status": {"readyReplicas": ready}}


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_all_pools_ready() -> None:
    """Every pool with ready pods gives Ready=True, summaries and the observed generation."""
    live = {"prefill": deployment(2, 2), "decode": deployment(4, 3), "router": deployment(1, 1)}
    status = running_status(isvc(), SPEC, live, "http://s.n.svc", "T1")
    assert status["observedGeneration"] == 4 and status["url"] == "http://s.n.svc"
    assert status["prefill"] == {
        "desiredReplicas": 2,
        "readyReplicas": 2,
        "summary": "2/2",
        "replicas": 0,  # the rollout fields: tests/operator/test_rollout.py
        "updatedReplicas": 0,
        "availableReplicas": 0,
        "rolloutComplete": False,
    }
    assert status["decode"]["summary"] == "3/4"
    assert conditions(status) == {
        "Ready": ("True", "AllComponentsReady"),
        "PrefillReady": ("True", "ReplicasReady"),
        "DecodeReady": ("True", "PartiallyReady"),
        "RouterReady": ("True", "ReplicasReady"),
        "RolloutComplete": ("False", "RolloutInProgress"),
        "ModelNameConflict": ("False", "ModelNameUnique"),
    }


def test_missing_or_unready_pools_keep_ready_false() -> None:
    """A pool with no ready pods, or no Deployment yet, keeps Ready=False and says which."""
    live = {"prefill": deployment(1, 0), "decode": None, "router": deployment(1, 1)}
    status = running_status(isvc(), SPEC, live, "u", "T1")
    assert conditions(status)["Ready"] == ("False", "ComponentsNotReady")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["message"] == "waiting for PrefillReady, DecodeReady"
    assert conditions(status)["DecodeReady"] == ("False", "ScaledToZero")


def test_aggregated_pool_stands_for_prefill_and_decode() -> None:
    """In aggregated mode the engine pool fills both the prefill and the decode columns."""
    spec = parse_spec({"model": {"uri": "file:///m"}, "image": "b", "mode": "aggregated"})
    live = {"engine": deployment(3, 3), "router": deployment(1, 1)}
    status = running_status(isvc(), spec, live, "u", "T1")
    assert status["prefill"]["summary"] == status["decode"]["summary"] == "3/3"


def test_transition_times_move_only_on_status_changes() -> None:
    """A condition keeps its lastTransitionTime until its status flips."""
    old = [{"type": "Ready", "status": "False", "lastTransitionTime": "T0"}]
    same = merge_conditions(old, [{"type": "Ready", "status": "False", "reason": "X"}], "T1")
    flipped = merge_conditions(old, [{"type": "Ready", "status": "True", "reason": "Y"}], "T1")
    assert same[0]["lastTransitionTime"] == "T0" and flipped[0]["lastTransitionTime"] == "T1"


def test_failed_status_keeps_the_other_conditions() -> None:
    """A bad spec sets Ready=False with its reason and leaves the pool conditions as they were."""
    before = running_status(
        isvc(),
        SPEC,
        {"prefill": deployment(1, 1), "decode": deployment(1, 1), "router": deployment(1, 1)},
        "u",
        "T0",
    )
    after = failed_status(isvc(before), "MissingImage", "no image", "T1")
    assert conditions(after)["Ready"] == ("False", "MissingImage")
    assert conditions(after)["PrefillReady"] == ("True", "ReplicasReady")
    assert after["url"] == "u"


def test_the_gateway_url_when_the_gateway_serves_the_model() -> None:
    """With a gateway, the status names its URL (and the Ready message the model name there);
    a service whose model name another holds is not served there, so it gets none."""
    live = {"prefill": deployment(1, 1), "decode": deployment(1, 1), "router": deployment(1, 1)}
    gateway = "http://baton-gateway.baton-system.svc"
    status = running_status(isvc(), SPEC, live, "http://s.n.svc", "T1", gateway_url=gateway)
    assert status["url"] == "http://s.n.svc" and status["gatewayUrl"] == gateway
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert f"at {gateway} as model 'm'" in ready["message"]
    taken = running_status(
        isvc(status), SPEC, live, "http://s.n.svc", "T2", "a/b", None, None, gateway
    )
    assert "gatewayUrl" not in taken
    assert "gatewayUrl" not in running_status(isvc(status), SPEC, live, "http://s.n.svc", "T3")
