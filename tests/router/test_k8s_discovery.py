"""Kubernetes discovery against the emulated API server: ready endpoints with role and model,
live updates, namespace scoping, recovery from API errors, and only the operator's Services."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from typing import Any

import pytest

from baton.operator import crd
from baton.router.discovery import Endpoint
from baton.router.k8s_discovery import KubernetesDiscovery
from tests.support.kmock_server import ApiServer, endpoint_slice

Endpoints = frozenset[Endpoint]
SLICES = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
SERVICES = "/api/v1/namespaces/{ns}/services"
ISVCS = f"/apis/{crd.API_VERSION}/namespaces/{{ns}}/{crd.PLURAL}"


def service(
    ns: str, name: str, role: str | None, model: str | None, operator: bool = True
) -> dict[str, Any]:
    """A Service as the operator makes it for the InferenceService `name` (owned by it, which
    `publish` creates), or with `operator=False` the same labels on a Service nobody owns."""
    labels = {"app.kubernetes.io/name": "baton", "baton.dev/inference-service": name}
    if operator:
        labels["app.kubernetes.io/managed-by"] = "baton-operator"
    if role:
        labels["baton.dev/role"] = role
    meta: dict[str, Any] = {"name": f"{name}-{role or 'router'}", "namespace": ns, "labels": labels}
    if model:
        meta["annotations"] = {"baton.dev/served-model-name": model}
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {}}


def publish(server: ApiServer, svc: dict[str, Any], ready: dict[str, bool]) -> None:
    """Creates the Service (owned by its InferenceService, created first, when the operator's
    label says the operator made it) and the EndpointSlice Kubernetes would make for it."""
    import httpx

    ns = svc["metadata"]["namespace"]
    svc = dict(svc, metadata=dict(svc["metadata"]))
    with httpx.Client(base_url=server.url, headers=server.headers()) as http:
        if svc["metadata"]["labels"].get("app.kubernetes.io/managed-by") == "baton-operator":
            name = svc["metadata"]["labels"]["baton.dev/inference-service"]
            owner = http.get(f"{ISVCS.format(ns=ns)}/{name}")
            if owner.status_code == 404:
                body = {
                    "apiVersion": crd.API_VERSION,
                    "kind": crd.KIND,
                    "metadata": {"name": name, "namespace": ns},
                    "spec": {"model": {"uri": "hf://acme/x"}},
                }
                owner = http.post(ISVCS.format(ns=ns), json=body)
            ref = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": name}
            ref |= {"uid": owner.json()["metadata"]["uid"], "controller": True}
            svc["metadata"]["ownerReferences"] = [ref]
        assert http.post(SERVICES.format(ns=ns), json=svc).status_code == 201
        slice_ = endpoint_slice(svc, ready)
        assert http.post(SLICES.format(ns=ns), json=slice_).status_code == 201


def discover(
    kubeconfig: str,
    namespace: str | None,
    until: Callable[[Endpoints], bool],
    then: Callable[[], None] | None = None,
    until_after: Callable[[Endpoints], bool] | None = None,
    selector: dict[str, str] | None = None,
) -> list[Endpoints]:
    """Runs discovery until `until` holds (then runs `then` and waits for `until_after`);
    returns every set it published."""
    seen: list[Endpoints] = []

    async def main() -> None:
        changed = asyncio.Event()
        discovery = KubernetesDiscovery(
            namespace, selector or {"app.kubernetes.io/name": "baton"}, kubeconfig=kubeconfig
        )

        def on_change(endpoints: Endpoints) -> None:
            seen.append(endpoints)
            changed.set()

        async def wait(check: Callable[[Endpoints], bool]) -> None:
            while not (seen and check(seen[-1])):
                changed.clear()
                await changed.wait()

        task = asyncio.create_task(discovery.run(on_change))
        try:
            await asyncio.wait_for(wait(until), 10)
            if then is not None and until_after is not None:
                await asyncio.to_thread(then)
                await asyncio.wait_for(wait(until_after), 10)
        finally:
            task.cancel()
            # An exec plugin's finished subprocess is closed while this loop still runs.
            gc.collect()

    asyncio.run(main())
    return seen


def test_ready_endpoints_carry_role_and_model(api: tuple[ApiServer, str]) -> None:
    """Ready endpoints become engines with the slice's role and the Service's model; unready
    ones and Services without a role (the router's own) are left out."""
    server, config = api
    publish(server, service("a", "llama", "prefill", "org/llama"), {"10.0.0.1": True})
    publish(
        server, service("a", "llama", "decode", "org/llama"), {"10.0.0.2": True, "10.0.0.3": False}
    )
    publish(server, service("a", "llama", None, None), {"10.0.0.9": True})
    final = discover(config, "a", lambda eps: len(eps) == 2)[-1]
    assert final == {
        Endpoint("http://10.0.0.1:8000", "prefill", "org/llama"),
        Endpoint("http://10.0.0.2:8000", "decode", "org/llama"),
    }


def test_changes_are_published_as_full_sets(api: tuple[ApiServer, str]) -> None:
    """An endpoint becoming ready after start shows up in the next full set."""
    server, config = api
    svc = service("a", "qwen", "both", "qwen")
    publish(server, svc, {"10.0.1.1": True})

    def second_pod_ready() -> None:
        import httpx

        slice_ = endpoint_slice(svc, {"10.0.1.1": True, "10.0.1.2": True})
        path = SLICES.format(ns="a") + "/" + slice_["metadata"]["name"]
        headers = {"Content-Type": "application/merge-patch+json"}
        httpx.patch(server.url + path, json={"endpoints": slice_["endpoints"]}, headers=headers)

    seen = discover(
        config, "a", lambda eps: len(eps) == 1, second_pod_ready, lambda eps: len(eps) == 2
    )
    assert seen[-1] == {
        Endpoint("http://10.0.1.1:8000", "both", "qwen"),
        Endpoint("http://10.0.1.2:8000", "both", "qwen"),
    }


def test_namespace_scope(api: tuple[ApiServer, str]) -> None:
    """A namespaced discovery sees only its namespace; a cluster-wide one sees every model."""
    server, config = api
    publish(server, service("a", "llama", "both", "llama"), {"10.0.0.1": True})
    publish(server, service("b", "qwen", "both", "qwen"), {"10.0.0.2": True})
    only_a = discover(config, "a", lambda eps: len(eps) >= 1)[-1]
    assert {e.model for e in only_a} == {"llama"}
    everywhere = discover(config, None, lambda eps: len(eps) == 2)[-1]
    assert {e.model for e in everywhere} == {"llama", "qwen"}


def test_api_errors_are_retried(api: tuple[ApiServer, str]) -> None:
    """Failing API calls are logged and retried until discovery gets through."""
    server, config = api
    publish(server, service("a", "llama", "both", "llama"), {"10.0.0.1": True})
    server.handler.fail_next = 2
    final = discover(config, "a", lambda eps: len(eps) == 1)[-1]
    assert {e.url for e in final} == {"http://10.0.0.1:8000"}
    assert server.handler.fail_next == 0


def test_an_empty_selector_is_refused() -> None:
    """Discovery without a selector would route to any Service's endpoints, so it is refused."""
    with pytest.raises(ValueError, match="selector"):
        KubernetesDiscovery("a", {})


def test_only_the_operators_services_are_routed(api: tuple[ApiServer, str]) -> None:
    """A look-alike Service in another namespace, with every label and the model annotation
    but no owner reference, is ignored by a cluster-wide discovery (the gateway's), and so is
    one with the owner reference but without the managed-by label."""
    server, config = api
    publish(server, service("team-a", "llama", "both", "llama"), {"10.0.0.1": True})
    publish(server, service("evil", "llama", "both", "llama", operator=False), {"10.6.6.6": True})
    half = service("evil2", "llama", "both", "llama")
    publish(server, half, {"10.6.6.7": True})
    import httpx

    path = SERVICES.format(ns="evil2") + "/llama-both"
    patch = {"metadata": {"labels": {"app.kubernetes.io/managed-by": None}}}
    headers = {"Content-Type": "application/merge-patch+json"} | server.headers()
    assert httpx.patch(server.url + path, json=patch, headers=headers).status_code == 200
    final = discover(config, None, lambda eps: len(eps) >= 1)[-1]
    assert final == {Endpoint("http://10.0.0.1:8000", "both", "llama")}
