"""The operator's API calls, on plain JSON objects, through kubernetes_asyncio's generic client
(which finds each kind's path through the server's API discovery): get, list, server-side apply,
delete, a status patch and a create. Errors are the library's `DynamicApiError`s (an
`ApiException` with the HTTP `status`; `NotFoundError` for 404 and so on).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from kubernetes_asyncio.dynamic import DynamicClient, Resource
from kubernetes_asyncio.dynamic.exceptions import NotFoundError

from baton.kube import Manifest, checked
from baton.kube import resource as lookup

MERGE_PATCH = "application/merge-patch+json"


class Api:
    """One client's calls; resource lookups are cached for the client's life."""

    def __init__(self, client: DynamicClient, timeout: float = 30.0) -> None:
        self.client = client
        self.timeout = timeout  # seconds for one call: a hung server fails the pass, not stalls it
        # One lookup per kind, shared by the calls that need it meanwhile: a pass applies a
        # dozen children at once, and each lookup that misses rewrites the discovery cache file.
        self._resources: dict[tuple[str, str], asyncio.Task[Resource]] = {}

    async def resource(self, api_version: str, kind: str) -> Resource:
        key = (api_version, kind)
        task = self._resources.get(key)
        if task is None:
            task = asyncio.ensure_future(lookup(self.client, api_version, kind))
            self._resources[key] = task
        try:
            return await asyncio.shield(task)
        except Exception:
            if self._resources.get(key) is task:
                del self._resources[key]  # the next call looks again
            raise

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        """The object, or None when it does not exist."""
        handle = await self.resource(api_version, kind)
        try:
            return await checked(
                self.client.get(handle, name, namespace, serialize=False, **self._timeout)
            )
        except NotFoundError:
            return None

    async def list(
        self, api_version: str, kind: str, namespace: str | None, label_selector: str | None = None
    ) -> list[Manifest]:
        """The objects in `namespace` (None: every namespace) that match `label_selector`."""
        handle = await self.resource(api_version, kind)
        found = await checked(
            self.client.get(
                handle,
                namespace=namespace,
                label_selector=label_selector,
                serialize=False,
                **self._timeout,
            )
        )
        items: list[Manifest] = found.get("items") or []
        return items

    async def apply(self, obj: Manifest, field_manager: str, force: bool = True) -> Manifest:
        """Server-side apply of `obj` (created when absent) as `field_manager`; with `force`,
        fields other managers changed are taken back. Returns the object as the server holds
        it."""
        handle = await self.resource(obj["apiVersion"], obj["kind"])
        call = self.client.server_side_apply(
            handle,
            body=obj,
            field_manager=field_manager,
            force_conflicts=force,
            serialize=False,
            **self._timeout,
        )
        return await checked(call)

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Deletes in the background (dependents are garbage-collected); absent is fine."""
        handle = await self.resource(api_version, kind)
        call = self.client.delete(
            handle,
            name,
            namespace,
            propagation_policy="Background",
            serialize=False,
            **self._timeout,
        )
        with contextlib.suppress(NotFoundError):
            await checked(call)

    async def patch_status(self, obj: Manifest, patch: Manifest) -> Manifest:
        """A JSON merge patch of `obj`'s status subresource (nulls remove keys)."""
        handle = await self.resource(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        status: Resource = handle.subresources["status"]
        call = self.client.patch(
            status,
            body=patch,
            name=meta["name"],
            namespace=meta["namespace"],
            content_type=MERGE_PATCH,
            serialize=False,
            **self._timeout,
        )
        return await checked(call)

    async def create(self, obj: Manifest) -> Manifest:
        handle = await self.resource(obj["apiVersion"], obj["kind"])
        namespace = obj["metadata"].get("namespace")
        call = self.client.create(
            handle, body=obj, namespace=namespace, serialize=False, **self._timeout
        )
        return await checked(call)

    @property
    def _timeout(self) -> dict[str, Any]:
        return {"_request_timeout": self.timeout}
