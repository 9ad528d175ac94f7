"""Revision-coherent rollouts and drains Kubernetes honours: the revision label on engine pods,
the rollout fields in status as the emulated Deployments move, and the engine's and router's
shutdown timeouts and grace periods derived from `spec.drain.timeoutSeconds`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from baton.engine.api.cli import add_server_args, configs_from_args
from baton.operator import crd
from baton.operator.reconciler import Reconciler
from baton.operator.resources import desired_children
from baton.operator.revision import REVISION_LABEL
from baton.operator.spec import parse_spec
from baton.operator.validation import SpecError, defaulted_spec
from baton.router.cli import add_args as add_router_args
from baton.router.cli import listen_from_args
from tests.operator.conftest import Kube
from tests.operator.test_reconciler import run

NS = "serving"
ISVC = f"/apis/baton.dev/v1alpha1/namespaces/{NS}/inferenceservices/llama"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
BASE: dict[str, Any] = {"model": {"uri": "hf://acme/llama-8b@main"}, "image": "baton:1"}
META = {"name": "llama", "namespace": NS, "uid": "uid-1"}


def deployments(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    children = desired_children({"metadata": META}, parse_spec(spec))
    return {c["metadata"]["name"]: c for c in children if c["kind"] == "Deployment"}


def pod_revisions(spec: dict[str, Any]) -> dict[str, str | None]:
    return {
        name: d["spec"]["template"]["metadata"]["labels"].get(REVISION_LABEL)
        for name, d in deployments(spec).items()
    }


def revision(spec: dict[str, Any]) -> str:
    found = pod_revisions(spec)
    assert found["llama-prefill"] == found["llama-decode"]
    value = found["llama-prefill"]
    assert value is not None
    return value


def test_engine_pods_of_one_spec_share_a_revision_label() -> None:
    """Prefill and decode pods carry the same 10-hex revision; the router's pods none; the
    immutable selectors and the Services' selectors leave it out."""
    found = pod_revisions(BASE)
    value = found["llama-prefill"]
    assert value is not None and len(value) == 10 and int(value, 16) >= 0
    assert found == {"llama-prefill": value, "llama-decode": value, "llama-router": None}
    children = desired_children({"metadata": META}, parse_spec(BASE))
    for child in children:
        if child["kind"] in ("Deployment", "Service"):
            selector = child["spec"]["selector"]
            assert REVISION_LABEL not in selector.get("matchLabels", selector)
    aggregated = deployments(BASE | {"mode": "aggregated"})["llama-engine"]
    assert REVISION_LABEL in aggregated["spec"]["template"]["metadata"]["labels"]
    assert aggregated["metadata"]["labels"][REVISION_LABEL] == revision_of(aggregated)


def revision_of(deployment: dict[str, Any]) -> str:
    return deployment["spec"]["template"]["metadata"]["labels"][REVISION_LABEL]  # type: ignore[no-any-return]


KV_FIELDS: dict[str, dict[str, Any]] = {
    "model revision": {"model": {"uri": "hf://acme/llama-8b@v2"}},
    "model": {"model": {"uri": "pvc://weights/llama"}},
    "image": {"image": "baton:2"},
    "dtype": {"engine": {"dtype": "bfloat16"}},
    "block size": {"engine": {"blockSize": 32}},
    "tensor parallel": {"engine": {"tensorParallelSize": 2}},
    "transport": {"kvTransfer": {"transport": "nixl"}},
    "extra args": {"engine": {"extraArgs": ["--tokenizer", "/models/other"]}},
}
OTHER_FIELDS: dict[str, dict[str, Any]] = {
    "replicas": {"prefill": {"replicas": 3}, "decode": {"replicas": 5}},
    "autoscaling": {"decode": {"autoscaling": {"maxReplicas": 4}}},
    "served name": {"model": {"uri": "hf://acme/llama-8b@main", "servedModelName": "x"}},
    "lease": {"kvTransfer": {"leaseSeconds": 90}},
    "load failure policy": {"kvTransfer": {"loadFailurePolicy": "fail"}},
    "max seqs": {"engine": {"maxNumSeqs": 8}},
    "drain": {"drain": {"timeoutSeconds": 300}},
    "router": {"router": {"policy": "round-robin", "replicas": 2}},
    "pull policy": {"imagePullPolicy": "Always"},
    "resources": {"prefill": {"resources": {"limits": {"memory": "8Gi"}}}},
}


@pytest.mark.parametrize("change", sorted(KV_FIELDS))
def test_the_revision_changes_with_each_kv_field(change: str) -> None:
    """Each field that changes what a KV block means (model and revision, image, dtype, block
    size, tensor-parallel size, transport, extra engine args) gives another revision."""
    assert revision(BASE | KV_FIELDS[change]) != revision(BASE)


@pytest.mark.parametrize("change", sorted(OTHER_FIELDS))
def test_the_revision_ignores_other_fields(change: str) -> None:
    """Replicas, autoscaling, names, lease, drain, router and resources keep the revision."""
    assert revision(BASE | OTHER_FIELDS[change]) == revision(BASE)


def test_an_aggregated_service_ignores_the_transport() -> None:
    """An aggregated pool runs no KV transport, so naming one does not roll its pods."""
    spec = BASE | {"mode": "aggregated"}
    nixl = spec | {"kvTransfer": {"transport": "nixl"}}
    assert revision_of(deployments(spec)["llama-engine"]) == revision_of(
        deployments(nixl)["llama-engine"]
    )


# ---- drain -----------------------------------------------------------------------------------


def engine_config(deployment: dict[str, Any]) -> Any:
    """What `baton engine` makes of the pod's args: its ServerConfig."""
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    _, server = configs_from_args(parser.parse_args(args[1:]))
    return server


def grace(deployment: dict[str, Any]) -> int:
    return deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("drain", [None, 0, 45, 600])
def test_shutdown_timeouts_and_grace_periods_follow_the_drain_field(drain: int | None) -> None:
    """The engines' --shutdown-timeout is the drain time (plus the lease and its poll on
    prefill, which must outlive its leases), the router's is the drain time, and each grace
    period covers preStop, that timeout and the process's exit."""
    spec = BASE | {"kvTransfer": {"leaseSeconds": 40}}
    if drain is not None:
        spec["drain"] = {"timeoutSeconds": drain}
    timeout = 120 if drain is None else drain
    built = deployments(spec)
    prefill, decode = engine_config(built["llama-prefill"]), engine_config(built["llama-decode"])
    assert prefill.shutdown_timeout == timeout + 40 + 1
    assert decode.shutdown_timeout == timeout
    assert grace(built["llama-prefill"]) == 10 + timeout + 40 + 1 + 15
    assert grace(built["llama-decode"]) == 10 + timeout + 15
    aggregated = deployments(spec | {"mode": "aggregated"})["llama-engine"]
    assert engine_config(aggregated).shutdown_timeout == timeout
    assert grace(aggregated) == 10 + timeout + 15

    parser = argparse.ArgumentParser()
    add_router_args(parser)
    router = built["llama-router"]
    args = parser.parse_args(router["spec"]["template"]["spec"]["containers"][0]["args"][1:])
    assert listen_from_args(args).shutdown_timeout == timeout
    assert grace(router) == 10 + timeout + 5


def test_the_crd_declares_the_drain_field() -> None:
    """The CRD has spec.drain.timeoutSeconds with today's 120 s default and bounds; the schema
    the operator applies keeps it (a field it did not know would be pruned)."""
    field = crd.SPEC["properties"]["drain"]["properties"]["timeoutSeconds"]
    assert (field["type"], field["default"], field["minimum"]) == ("integer", 120, 0)
    assert field["maximum"] == 3600
    assert defaulted_spec(BASE)["drain"] == {"timeoutSeconds": 120}
    assert defaulted_spec(BASE | {"drain": {"timeoutSeconds": 7}})["drain"]["timeoutSeconds"] == 7
    assert parse_spec(BASE | {"drain": {"timeoutSeconds": 7}}).drain.timeout_seconds == 7
    manifest = crd.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert "drain" in manifest["properties"]["spec"]["properties"]


@pytest.mark.parametrize(
    ("drain", "reason", "fragment"),
    [
        ({"timeoutSeconds": -1}, "InvalidSpec", "spec.drain.timeoutSeconds must be at least 0"),
        ({"timeoutSeconds": 10**6}, "InvalidSpec", "must be at most 3600"),
        ({"timeoutSeconds": "60"}, "InvalidSpec", "must be an integer"),
    ],
)
def test_bad_drain_timeouts_are_refused(drain: Any, reason: str, fragment: str) -> None:
    """A negative, absurd or mistyped drain timeout is a SpecError naming the field."""
    with pytest.raises(SpecError) as info:
        parse_spec(BASE | {"drain": drain})
    assert info.value.reason == reason and fragment in info.value.message


@pytest.mark.parametrize("arg", ["--shutdown-timeout", "--shutdown-timeout=5"])
def test_extra_args_cannot_override_the_drain(arg: str) -> None:
    """`--shutdown-timeout` in extraArgs would break the arithmetic the grace period rests on."""
    with pytest.raises(SpecError) as info:
        parse_spec(BASE | {"engine": {"extraArgs": [arg, "5"]}})
    assert info.value.reason == "ReservedEngineArgument"
    assert "spec.drain.timeoutSeconds" in info.value.message


# ---- against the emulated API server -----------------------------------------------------------


def set_status(kube: Kube, name: str, **fields: Any) -> None:
    """Writes a Deployment's status as its controller would."""
    kube.patch(f"{DEPLOYMENTS}/{name}/status", {"status": fields})


def rolled_out(kube: Kube, name: str, replicas: int) -> None:
    deployment = kube.get(f"{DEPLOYMENTS}/{name}")
    assert deployment is not None
    set_status(
        kube,
        name,
        observedGeneration=deployment["metadata"]["generation"],
        replicas=replicas,
        updatedReplicas=replicas,
        readyReplicas=replicas,
        availableReplicas=replicas,
    )


def status(kube: Kube) -> dict[str, Any]:
    isvc = kube.isvc(NS, "llama")
    assert isvc is not None
    return isvc["status"]  # type: ignore[no-any-return]


def rollout(kube: Kube) -> tuple[str, str, str]:
    (cond,) = [c for c in status(kube)["conditions"] if c["type"] == "RolloutComplete"]
    return cond["status"], cond["reason"], cond["message"]


def test_rollout_status_follows_the_deployments(kube: Kube, tmp_path: Path) -> None:
    """Per pool: replicas, updated, ready, available, the revision and whether its rollout is
    complete (kubectl's rule), and a RolloutComplete condition over every pool, as the emulated
    Deployments' status moves through an image rollout."""
    kube.apply_isvc(NS, "llama", BASE | {"decode": {"replicas": 2}})

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")
        first = status(kube)
        old = first["revision"]
        assert first["prefill"]["revision"] == first["decode"]["revision"] == old
        assert first["prefill"]["rolloutComplete"] is False
        assert rollout(kube)[:2] == ("False", "RolloutInProgress")

        for name, replicas in (("llama-prefill", 1), ("llama-decode", 2), ("llama-router", 1)):
            rolled_out(kube, name, replicas)
        await reconciler.reconcile(NS, "llama")
        done = status(kube)
        assert done["decode"] | {"revision": None} == {
            "desiredReplicas": 2,
            "readyReplicas": 2,
            "summary": "2/2",
            "replicas": 2,
            "updatedReplicas": 2,
            "availableReplicas": 2,
            "rolloutComplete": True,
            "revision": None,
        }
        assert rollout(kube)[:2] == ("True", "RolloutComplete")
        assert old in rollout(kube)[2]

        kube.patch(ISVC, {"spec": {"image": "baton:2"}})
        await reconciler.reconcile(NS, "llama")
        new = status(kube)["revision"]
        assert new != old
        assert status(kube)["prefill"]["revision"] == status(kube)["decode"]["revision"] == new
        # The Deployments' controller has not seen the new generation yet.
        assert status(kube)["decode"]["rolloutComplete"] is False
        assert rollout(kube)[:2] == ("False", "RolloutInProgress")

        decode = kube.get(f"{DEPLOYMENTS}/llama-decode")
        assert decode is not None
        generation = decode["metadata"]["generation"]
        # One new pod up, two old ones still there.
        set_status(
            kube,
            "llama-decode",
            observedGeneration=generation,
            replicas=3,
            updatedReplicas=1,
            readyReplicas=3,
            availableReplicas=3,
        )
        await reconciler.reconcile(NS, "llama")
        assert status(kube)["decode"]["updatedReplicas"] == 1
        assert status(kube)["decode"]["replicas"] == 3
        state, reason, message = rollout(kube)
        assert (state, reason) == ("False", "RolloutInProgress")
        assert "decode: 1 of 2 replicas updated" in message

        # All new, one old pod still terminating.
        set_status(kube, "llama-decode", updatedReplicas=2, replicas=3)
        await reconciler.reconcile(NS, "llama")
        assert "decode: 1 old replicas pending termination" in rollout(kube)[2]

        for name, replicas in (("llama-prefill", 1), ("llama-decode", 2), ("llama-router", 1)):
            rolled_out(kube, name, replicas)
        await reconciler.reconcile(NS, "llama")
        assert rollout(kube)[:2] == ("True", "RolloutComplete")
        assert all(status(kube)[p]["rolloutComplete"] for p in ("prefill", "decode", "router"))
        ready = [c for c in status(kube)["conditions"] if c["type"] == "Ready"]
        assert ready[0]["status"] == "True"

        conditions = [
            {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}
        ]
        set_status(kube, "llama-prefill", conditions=conditions)
        await reconciler.reconcile(NS, "llama")
        state, reason, message = rollout(kube)
        assert (state, reason) == ("False", "ProgressDeadlineExceeded")
        assert "prefill" in message

    run(kube, tmp_path, body)


def test_a_bad_drain_timeout_is_a_condition_and_an_event(kube: Kube, tmp_path: Path) -> None:
    """Against the emulator a negative drain timeout gives Ready=False (InvalidSpec) and a
    Warning Event, and builds nothing."""
    kube.apply_isvc(NS, "llama", BASE | {"drain": {"timeoutSeconds": -5}})

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")

    run(kube, tmp_path, body)
    (ready,) = [c for c in status(kube)["conditions"] if c["type"] == "Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "spec.drain.timeoutSeconds" in ready["message"]
    (event,) = kube.server.objects("events", NS)
    assert (event["type"], event["reason"]) == ("Warning", "InvalidSpec")
    assert kube.names("deployments", NS) == set()


def test_the_applied_deployments_carry_the_derived_drain(kube: Kube, tmp_path: Path) -> None:
    """What the emulated API server holds after a pass has the revision label, the engine's
    --shutdown-timeout and the grace period from spec.drain."""
    kube.apply_isvc(NS, "llama", BASE | {"drain": {"timeoutSeconds": 30}})

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")

    run(kube, tmp_path, body)
    prefill = kube.get(f"{DEPLOYMENTS}/llama-prefill")
    decode = kube.get(f"{DEPLOYMENTS}/llama-decode")
    assert prefill is not None and decode is not None
    assert engine_config(prefill).shutdown_timeout == 30 + 30 + 1
    assert grace(prefill) == 10 + 61 + 15 and grace(decode) == 10 + 30 + 15
    assert revision_of(prefill) == revision_of(decode) == status(kube)["revision"]
