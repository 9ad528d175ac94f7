"""The operator's API calls, on plain JSON objects: get, list, server-side apply, delete, a status
patch, a create, and whether the server serves a kind (discovery). Errors are the library's
`DynamicApiError`s (an `ApiException` with the HTTP `status`; `NotFoundError` for 404 and so
on).
"""

from __future__ import annotations

import contextlib

from kubernetes_asyncio.dynamic.exceptions import NotFoundError

from baton.kube import Cluster, Manifest, resource_path
from baton.operator import crd

# The plural (path) name of every kind the operator reads or writes.
PLURALS = {
    crd.KIND: crd.PLURAL,
    "Deployment": "deployments",
    "Service": "services",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "ServiceAccount": "serviceaccounts",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "NetworkPolicy": "networkpolicies",
    "Secret": "secrets",
    "EndpointSlice": "endpointslices",
    "Event": "events",
    "PodMonitor": "podmonitors",
    "ScaledObject": "scaledobjects",
}
APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"


def _path(api_version: str, kind: str, namespace: str | None, name: str = "") -> str:
    return resource_path(api_version, PLURALS[kind], namespace, name)


def _path_of(obj: Manifest) -> str:
    meta = obj["metadata"]
    return _path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta.get("name", ""))


class Api:
    """The operator's calls through one `Cluster`."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    async def serves(self, api_version: str, kind: str) -> bool:
        """Whether the server serves `kind` in `api_version`, from its discovery document (which
        every account may read): False when the group or version is unknown, as a CRD not
        installed is."""
        group, _, version = api_version.rpartition("/")
        path = f"/apis/{group}/{version}" if group else f"/api/{version}"
        try:
            found = await self.cluster.request("GET", path)
        except NotFoundError:
            return False
        return any(r.get("kind") == kind for r in found.get("resources") or [])

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        """The object, or None when it does not exist."""
        try:
            return await self.cluster.request("GET", _path(api_version, kind, namespace, name))
        except NotFoundError:
            return None

    async def list(
        self, api_version: str, kind: str, namespace: str | None, label_selector: str | None = None
    ) -> list[Manifest]:
        """The objects in `namespace` (None: every namespace) that match `label_selector`."""
        query = {"labelSelector": label_selector} if label_selector else None
        found = await self.cluster.request("GET", _path(api_version, kind, namespace), query=query)
        items: list[Manifest] = found.get("items") or []
        return items

    async def apply(self, obj: Manifest, field_manager: str, force: bool = True) -> Manifest:
        """Server-side apply of `obj` (created when absent) as `field_manager`; with `force`,
        fields other managers changed are taken back. Returns the object as the server holds
        it."""
        query = {"fieldManager": field_manager, "force": "true" if force else "false"}
        return await self.cluster.request(
            "PATCH", _path_of(obj), query=query, body=obj, content_type=APPLY_PATCH
        )

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Deletes in the background (dependents are garbage-collected); absent is fine."""
        query = {"propagationPolicy": "Background"}
        with contextlib.suppress(NotFoundError):
            path = _path(api_version, kind, namespace, name)
            await self.cluster.request("DELETE", path, query=query)

    async def patch_status(self, obj: Manifest, patch: Manifest) -> Manifest:
        """A JSON merge patch of `obj`'s status subresource (nulls remove keys)."""
        path = _path_of(obj) + "/status"
        return await self.cluster.request("PATCH", path, body=patch, content_type=MERGE_PATCH)

    async def create(self, obj: Manifest, field_manager: str | None = None) -> Manifest:
        """Creates `obj` (named, or with a `generateName`); a name that is taken raises
        `ConflictError` (409 AlreadyExists)."""
        query = {"fieldManager": field_manager} if field_manager else None
        return await self.cluster.request("POST", _path_of(obj), query=query, body=obj)
