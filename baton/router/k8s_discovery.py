"""Kubernetes discovery for the router: engines are the ready endpoints of the EndpointSlices
that match a label selector, in one namespace or all. The role comes from the slice's
`baton.dev/role` label (Kubernetes copies the Service's labels onto its slices) and the served
model from the owning Service's `baton.dev/served-model-name` annotation. Only Services the
operator made count: the managed-by label and a controller owner reference to an
InferenceService, both (a label alone is easy to copy onto a look-alike Service in any
namespace; an owner reference to a missing owner is garbage-collected). Keeps the `Discovery`
contract of `discovery.py`: the full set goes to `on_change` whenever it changes, and API errors
are logged and retried with backoff. Talks to the API server through `baton.kube.connect`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

from baton.kube import (
    ISVC_LABEL,
    MANAGED_BY_LABEL,
    OPERATOR_NAME,
    OWNER_GROUP,
    OWNER_KIND,
    ROLE_LABEL,
    SERVED_MODEL_ANNOTATION,
    Cluster,
    Manifest,
    connect,
    resource_path,
)
from baton.roles import ROLES, Role
from baton.router.discovery import Endpoint, OnChange

logger = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # set by Kubernetes on every EndpointSlice
WATCH_SECONDS = 300  # the server ends each watch after this; the next one resumes from there
MAX_BACKOFF = 30.0  # seconds between failed rounds, at most
PORT_NAME = "http"  # the engines' HTTP API port in their EndpointSlices (the operator's name)

# What a failed round raises: the API's answers, the connection, malformed objects.
RETRIED = (ApiException, aiohttp.ClientError, TimeoutError, ValueError, KeyError)

ROLE_OF: dict[str, Role] = {role: role for role in ROLES}

ObjectKey = tuple[str, str]  # namespace, name


class _Untrusted:
    """What is kept of a Service the operator did not make: its slices are not routed."""


UNTRUSTED = _Untrusted()


class KubernetesDiscovery:
    """Engines from EndpointSlices selected by labels."""

    def __init__(
        self,
        namespace: str | None,
        selector: Mapping[str, str],
        kubeconfig: str | None = None,
    ) -> None:
        """How the router's flags map here: `--discovery kubernetes --namespace NS` gives
        `namespace="NS"`, `--all-namespaces` gives `namespace=None`, and
        `--selector k=v,k2=v2` gives `selector={"k": "v", "k2": "v2"}` (every pair must match).
        `kubeconfig` defaults to the in-cluster service account, else `$KUBECONFIG`
        (`baton.kube.connect`); the account needs get/list/watch on endpointslices and
        services."""
        if not selector:
            raise ValueError("Kubernetes discovery needs a label selector, e.g. app=baton")
        self.namespace = namespace
        self.selector = ",".join(f"{k}={v}" for k, v in selector.items())
        self._kubeconfig = kubeconfig
        # What is kept of each object of each kind listed so far: a slice, a Service's served
        # model. Nothing is published before both are listed, so engines never appear without
        # their model first.
        self._seen: dict[str, dict[ObjectKey, Any]] = {}
        self._published: frozenset[Endpoint] | None = None
        self._failures = 0  # consecutive failed rounds, for the backoff

    async def run(self, on_change: OnChange) -> None:
        """Lists, then watches, slices and Services until cancelled; relists after any error
        (connecting again when connecting failed)."""
        cluster: Cluster | None = None
        try:
            while True:
                try:
                    if cluster is None:
                        cluster = await connect(self._kubeconfig)
                    # Either watch failing ends both; the next round relists both.
                    async with asyncio.TaskGroup() as group:
                        slices = ("discovery.k8s.io/v1", "endpointslices", lambda s: s)
                        group.create_task(self._follow(cluster, *slices, on_change))
                        services = ("v1", "services", _operator_service)
                        group.create_task(self._follow(cluster, *services, on_change))
                except* RETRIED as e:
                    delay = min(MAX_BACKOFF, 0.5 * 2**self._failures)
                    self._failures += 1
                    causes = "; ".join(str(x).strip() for x in e.exceptions)
                    logger.warning("Kubernetes discovery: %s; retrying in %.1fs", causes, delay)
                    await asyncio.sleep(delay)
        finally:
            if cluster is not None:
                await cluster.close()

    async def _follow(
        self,
        cluster: Cluster,
        api_version: str,
        plural: str,
        keep: Callable[[Manifest], Any],
        on_change: OnChange,
    ) -> None:
        """Keeps what `keep` takes of one kind's objects current: a list, then watches from its
        resourceVersion."""
        path = resource_path(api_version, plural, self.namespace)
        query = {"labelSelector": self.selector}
        listed = await cluster.request("GET", path, query=query)
        self._failures = 0
        store = self._seen[plural] = {_key(i): keep(i) for i in listed.get("items") or []}
        self._publish(on_change)
        version = listed["metadata"]["resourceVersion"]
        # An ERROR event (410 Gone when `version` is too old) raises; the caller relists.
        while True:
            watch = cluster.watch(path, {**query, "resourceVersion": version}, WATCH_SECONDS)
            async for event in watch:
                obj = event["object"]
                version = obj.get("metadata", {}).get("resourceVersion", version)
                if event["type"] == "BOOKMARK":
                    continue
                if event["type"] == "DELETED":
                    store.pop(_key(obj), None)
                else:
                    store[_key(obj)] = keep(obj)
                self._publish(on_change)

    def _publish(self, on_change: OnChange) -> None:
        if len(self._seen) < 2:
            return
        endpoints = frozenset(self.endpoints())
        if endpoints != self._published:
            self._published = endpoints
            on_change(endpoints)

    def endpoints(self) -> set[Endpoint]:
        """The ready engines in the slices seen so far."""
        result: set[Endpoint] = set()
        models = self._seen.get("services", {})
        for (namespace, _), item in self._seen.get("endpointslices", {}).items():
            labels = item.get("metadata", {}).get("labels") or {}
            role = ROLE_OF.get(labels.get(ROLE_LABEL, ""))
            if role is None:
                continue  # e.g. the router's own Service, which matches a broad selector
            ports = [p.get("port") for p in item.get("ports") or [] if p.get("name") == PORT_NAME]
            if not ports or ports[0] is None:
                continue
            # A slice counts only once its Service is seen and known to be the operator's.
            model = models.get((namespace, labels.get(SERVICE_NAME_LABEL, "")), UNTRUSTED)
            if isinstance(model, _Untrusted):
                continue
            for endpoint in item.get("endpoints") or []:
                conditions = endpoint.get("conditions") or {}
                # An unset `ready` means unknown, which consumers treat as ready.
                if conditions.get("ready") is False or conditions.get("terminating"):
                    continue
                for address in (endpoint.get("addresses") or [])[:1]:
                    host = f"[{address}]" if ":" in address else address
                    result.add(Endpoint(f"http://{host}:{ports[0]}", role, model))
        return result


def _key(obj: Manifest) -> ObjectKey:
    meta = obj["metadata"]
    return meta.get("namespace", ""), meta["name"]


def made_by_operator(service: Manifest) -> bool:
    """Whether `service` carries both marks of the operator's children: the managed-by label
    and a controller owner reference to the InferenceService its label names."""
    meta = service.get("metadata", {})
    labels = meta.get("labels") or {}
    if labels.get(MANAGED_BY_LABEL) != OPERATOR_NAME:
        return False
    return any(
        ref.get("controller") is True
        and ref.get("kind") == OWNER_KIND
        and str(ref.get("apiVersion", "")).partition("/")[0] == OWNER_GROUP
        and ref.get("name") == labels.get(ISVC_LABEL)
        for ref in meta.get("ownerReferences") or []
    )


def _operator_service(service: Manifest) -> str | _Untrusted | None:
    if not made_by_operator(service):
        return UNTRUSTED
    annotations = service.get("metadata", {}).get("annotations") or {}
    name = annotations.get(SERVED_MODEL_ANNOTATION)
    return str(name) if name else None
