"""The trust boundary against the emulated API server: each InferenceService gets an owned,
server-side applied NetworkPolicy fencing its engines; a served model name already held by an
earlier service gives the later one `ModelNameConflict` and keeps its engines from the gateway;
the API key Secret reaches engines and router."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from baton.kube import connect
from baton.operator.api import Api
from baton.operator.reconciler import Reconciler
from baton.operator.resources import MANAGER, NetworkAccess
from tests.operator.conftest import Kube
from tests.router.test_k8s_discovery import discover
from tests.support.kmock_server import endpoint_slice

NETPOL = "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies/{name}-engines"
GATEWAY_SELECTOR = {"app.kubernetes.io/name": "baton", "baton.dev/gateway": "true"}


def reconcile(kube: Kube, tmp_path: Path, *keys: tuple[str, str], **options: Any) -> None:
    """One reconcile pass for each (namespace, name), in order, by one operator's reconciler."""

    async def main() -> None:
        cluster = await connect(str(kube.server.write_kubeconfig(tmp_path / "kubeconfig")))
        try:
            reconciler = Reconciler(Api(cluster), **options)
            for key in keys:
                await reconciler.reconcile(*key)
        finally:
            await cluster.close()

    asyncio.run(main())


def conditions(kube: Kube, ns: str, name: str) -> dict[str, dict[str, Any]]:
    isvc = kube.isvc(ns, name)
    assert isvc is not None
    return {c["type"]: c for c in isvc["status"]["conditions"]}


def test_each_service_gets_a_network_policy(kube: Kube, tmp_path: Path) -> None:
    """The policy is applied (server-side, by the operator's manager), owned by its service,
    and lets engine HTTP in only from the service's router, the gateway, the operator's pods
    (its KV canary) and monitoring, and
    every tensor-parallel rank's KV port only from the service's decode pods."""
    spec = {
        "model": {"uri": "hf://acme/llama"},
        "image": "b:1",
        "engine": {"tensorParallelSize": 2},
    }
    owner = kube.apply_isvc("serving", "llama", spec)
    kube.apply_isvc("other", "qwen", {"model": {"uri": "hf://acme/qwen"}, "image": "b:1"})
    access = NetworkAccess("gw-ns", monitoring_namespace="prom", operator_namespace="ops")
    reconcile(kube, tmp_path, ("serving", "llama"), ("other", "qwen"), access=access)
    assert kube.get(NETPOL.format(ns="other", name="qwen")) is not None
    policy = kube.get(NETPOL.format(ns="serving", name="llama"))
    assert policy is not None
    meta = policy["metadata"]
    assert [(r["uid"], r["controller"]) for r in meta["ownerReferences"]] == [
        (owner["metadata"]["uid"], True)
    ]
    assert [(e["manager"], e["operation"]) for e in meta["managedFields"]] == [(MANAGER, "Apply")]
    spec_ = policy["spec"]
    assert spec_["policyTypes"] == ["Ingress"]
    assert spec_["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "llama"
    assert spec_["podSelector"]["matchExpressions"] == [
        {"key": "baton.dev/role", "operator": "Exists"}
    ]
    http, kv, events = spec_["ingress"]
    assert http["ports"] == [{"protocol": "TCP", "port": 8000}]
    router = {"app.kubernetes.io/name": "baton", "app.kubernetes.io/instance": "llama"}
    assert http["from"] == [
        {"podSelector": {"matchLabels": router | {"app.kubernetes.io/component": "router"}}},
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw-ns"}},
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "baton-gateway",
                    "app.kubernetes.io/component": "gateway",
                }
            },
        },
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}},
        },
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "prom"}}},
    ]
    assert kv["ports"] == [{"protocol": "TCP", "port": 14579}, {"protocol": "TCP", "port": 14580}]
    decode = router | {"app.kubernetes.io/component": "decode"}
    assert kv["from"] == [{"podSelector": {"matchLabels": decode}}]
    # The KV events (prompts' token ids) only to the routers: this service's and the gateway.
    assert events["ports"] == [{"protocol": "TCP", "port": 5557}, {"protocol": "TCP", "port": 5558}]
    assert events["from"] == http["from"][:2]


def test_a_later_service_with_a_taken_model_name_is_not_routed(kube: Kube, tmp_path: Path) -> None:
    """Two services in two namespaces serve "llama": the later one gets ModelNameConflict=True
    and a Warning Event, and the gateway's discovery sees only the earlier one's engines;
    once the earlier one is gone, the later one takes the name over."""
    spec = {"model": {"uri": "hf://acme/llama", "servedModelName": "llama"}, "image": "b:1"}
    kube.apply_isvc("team-a", "first", spec | {"mode": "aggregated"})
    kube.apply_isvc("team-b", "second", spec | {"mode": "aggregated"})
    reconcile(kube, tmp_path, ("team-a", "first"), ("team-b", "second"))
    assert conditions(kube, "team-a", "first")["ModelNameConflict"]["status"] == "False"
    later = conditions(kube, "team-b", "second")["ModelNameConflict"]
    assert later["status"] == "True" and later["reason"] == "ServedModelNameTaken"
    assert "team-a/first" in later["message"]
    events = [e for e in kube.server.objects("events", "team-b") if e["type"] == "Warning"]
    assert [e["reason"] for e in events] == ["ModelNameConflict"]

    address = {"team-a": "10.0.0.1", "team-b": "10.0.0.2"}
    for ns, name in (("team-a", "first"), ("team-b", "second")):
        svc = kube.get(f"/api/v1/namespaces/{ns}/services/{name}-engine")
        assert svc is not None
        slice_ = endpoint_slice(svc, {address[ns]: True})
        path = f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
        assert kube.http.post(path, json=slice_).status_code == 201
    config = str(kube.server.write_kubeconfig(tmp_path / "gateway"))
    final = discover(config, None, lambda eps: len(eps) >= 1, selector=GATEWAY_SELECTOR)[-1]
    assert {e.url for e in final} == {"http://10.0.0.1:8000"}
    # The later service's own router still finds its engines.
    own = {"baton.dev/inference-service": "second"}
    mine = discover(config, "team-b", lambda eps: len(eps) >= 1, selector=own)[-1]
    assert {e.url for e in mine} == {"http://10.0.0.2:8000"}

    kube.delete("/apis/baton.dev/v1alpha1/namespaces/team-a/inferenceservices/first")
    reconcile(kube, tmp_path, ("team-b", "second"))
    assert conditions(kube, "team-b", "second")["ModelNameConflict"]["status"] == "False"
    svc = kube.get("/api/v1/namespaces/team-b/services/second-engine")
    assert svc is not None and svc["metadata"]["labels"]["baton.dev/gateway"] == "true"


def test_the_api_key_secret_reaches_engines_and_router(kube: Kube, tmp_path: Path) -> None:
    """apiKeySecret becomes BATON_API_KEY in engine and router pods (secretKeyRef, never the
    value) and BATON_UPSTREAM_API_KEY in the router's."""
    spec = {"model": {"uri": "hf://acme/llama"}, "image": "b:1"}
    kube.apply_isvc("serving", "llama", spec | {"apiKeySecret": {"name": "keys", "key": "k"}})
    reconcile(kube, tmp_path, ("serving", "llama"))
    ref = {"valueFrom": {"secretKeyRef": {"name": "keys", "key": "k"}}}

    def env(deployment: str) -> dict[str, Any]:
        live = kube.get(f"/apis/apps/v1/namespaces/serving/deployments/{deployment}")
        assert live is not None
        (container,) = live["spec"]["template"]["spec"]["containers"]
        return {e["name"]: {k: v for k, v in e.items() if k != "name"} for e in container["env"]}

    for engine in ("llama-prefill", "llama-decode"):
        assert env(engine)["BATON_API_KEY"] == ref
        assert "BATON_UPSTREAM_API_KEY" not in env(engine)
    router = env("llama-router")
    assert router["BATON_API_KEY"] == ref and router["BATON_UPSTREAM_API_KEY"] == ref
