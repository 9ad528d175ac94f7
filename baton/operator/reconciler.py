"""Level-triggered reconciliation of one `InferenceService`: read it, build every desired child
with the pure builders, apply each idempotently, delete children it no longer wants, and write
the status from what the API reports, all from scratch on every pass. Whatever triggers a pass
(a change to the service, to a child, a retry, a resync), the outcome depends only on the
current state.

Triggers for one service coalesce: while a pass runs, further triggers mark it dirty and one
more pass follows, so a burst of child events costs at most one extra pass. A pass that fails
on the API is retried with exponential backoff; a bad spec is not retried (its next edit
triggers a pass) and shows as `Ready=False` with a reason and a Warning Event.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from baton.operator import crd
from baton.operator.apply import apply_patch, with_last_applied
from baton.operator.events import event_body
from baton.operator.kube import ApiError, KubeClient, resource_path
from baton.operator.resources import (
    COMPONENT_LABEL,
    ISVC_LABEL,
    MANAGED_BY_LABEL,
    MANAGER,
    desired_children,
    service_url,
)
from baton.operator.spec import parse_spec
from baton.operator.status import failed_status, now_iso, ready_condition, running_status
from baton.operator.validation import SpecError

logger = logging.getLogger(__name__)

Manifest = dict[str, Any]
Key = tuple[str, str]  # namespace, name

# Kind -> (apiVersion, plural) of every kind of child.
CHILD_KINDS: dict[str, tuple[str, str]] = {
    "Deployment": ("apps/v1", "deployments"),
    "Service": ("v1", "services"),
    "HorizontalPodAutoscaler": ("autoscaling/v2", "horizontalpodautoscalers"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "ServiceAccount": ("v1", "serviceaccounts"),
    "Role": ("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings"),
}
# Kinds of which a spec change can leave children behind (a mode switch, autoscaling off).
PRUNED_KINDS = ("Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget")


class ChildConflict(Exception):
    """A child's name is taken by an object that this service does not control."""


@dataclass
class _KeyState:
    running: bool = False
    dirty: bool = False
    failures: int = 0
    retry: asyncio.TimerHandle | None = None


@dataclass
class Reconciler:
    """Reconciles `InferenceService`s through `client`; one instance per operator process."""

    client: KubeClient
    default_image: str = ""
    max_backoff: float = 60.0
    _states: dict[Key, _KeyState] = field(default_factory=dict)
    # Generation each service was last pruned at: only a spec change can make a child
    # unwanted, so the lists that pruning needs run once per generation, not once per pass.
    _pruned: dict[Key, int] = field(default_factory=dict)
    # (kind, namespace, name) -> resourceVersion of the operator's own last write, so that the
    # watch event of that write does not trigger another pass (controller-runtime calls these
    # "expectations"). Any other version, or a deletion, still triggers one.
    _written: dict[tuple[str, str, str], str] = field(default_factory=dict)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def known(self) -> list[Key]:
        return list(self._states)

    async def trigger(self, namespace: str, name: str) -> None:
        """Reconciles now, or once more after the pass in progress. Never raises."""
        state = self._states.setdefault((namespace, name), _KeyState())
        state.dirty = True
        if state.running:
            return
        state.running = True
        try:
            while state.dirty:
                state.dirty = False
                await self._attempt((namespace, name), state)
        finally:
            state.running = False

    def own_write(self, kind: str, namespace: str, name: str, resource_version: str) -> bool:
        """Whether a watch event shows exactly the operator's last write of that object."""
        return self._written.get((kind, namespace, name)) == resource_version

    def _wrote(self, obj: Manifest) -> Manifest:
        meta = obj.get("metadata", {})
        if obj.get("kind") and meta.get("resourceVersion"):
            key = (obj["kind"], meta.get("namespace", ""), meta["name"])
            self._written[key] = meta["resourceVersion"]
        return obj

    def forget(self, namespace: str, name: str) -> None:
        """Drops a deleted service (its children go with it through owner references)."""
        self._pruned.pop((namespace, name), None)
        state = self._states.pop((namespace, name), None)
        if state is not None and state.retry is not None:
            state.retry.cancel()

    async def close(self) -> None:
        for state in self._states.values():
            if state.retry is not None:
                state.retry.cancel()
        for task in list(self._tasks):
            task.cancel()

    async def _attempt(self, key: Key, state: _KeyState) -> None:
        if state.retry is not None:
            state.retry.cancel()
            state.retry = None
        try:
            await self.reconcile(*key)
            state.failures = 0
        except (ApiError, aiohttp.ClientError, TimeoutError, ChildConflict) as e:
            delay = min(self.max_backoff, 0.5 * 2**state.failures)
            state.failures += 1
            logger.warning("reconcile %s/%s failed (%s); retry in %.1fs", *key, e, delay)
            state.retry = asyncio.get_running_loop().call_later(delay, self._spawn, key)

    def _spawn(self, key: Key) -> None:
        if key not in self._states:
            return
        task = asyncio.get_running_loop().create_task(self.trigger(*key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def reconcile(self, namespace: str, name: str) -> None:
        """One pass for one service; raises on API failures (the caller retries)."""
        path = resource_path(crd.API_VERSION, crd.PLURAL, namespace, name)
        isvc = await self.client.get(path)
        if isvc is None or isvc["metadata"].get("deletionTimestamp"):
            self.forget(namespace, name)
            return
        try:
            spec = parse_spec(isvc.get("spec"), self.default_image)
            desired = desired_children(isvc, spec)
        except SpecError as e:
            await self._write_status(isvc, failed_status(isvc, e.reason, e.message, now_iso()))
            return
        try:
            applied = await asyncio.gather(*(self._apply(isvc, child) for child in desired))
        except ChildConflict as e:
            await self._write_status(isvc, failed_status(isvc, "ChildConflict", str(e), now_iso()))
            raise
        generation = isvc["metadata"].get("generation", 0)
        if self._pruned.get((namespace, name)) != generation:
            await self._prune(isvc, desired)
            self._pruned[(namespace, name)] = generation
        deployments: dict[str, Manifest | None] = {}
        router_service = None
        for child, live in zip(desired, applied, strict=True):
            if child["kind"] == "Deployment":
                deployments[child["metadata"]["labels"][COMPONENT_LABEL]] = live
            elif child["kind"] == "Service" and child["metadata"]["name"] == name:
                router_service = live
        url = service_url(isvc, router_service)
        await self._write_status(isvc, running_status(isvc, spec, deployments, url, now_iso()))

    async def _apply(self, isvc: Manifest, child: Manifest) -> Manifest:
        """Creates or patches one child; returns it as the API server holds it."""
        api_version, plural = CHILD_KINDS[child["kind"]]
        meta = child["metadata"]
        path = resource_path(api_version, plural, meta["namespace"], meta["name"])
        desired = with_last_applied(child)
        live = await self.client.get(path)
        if live is None:
            logger.info("creating %s %s/%s", child["kind"], meta["namespace"], meta["name"])
            collection = resource_path(api_version, plural, meta["namespace"])
            try:
                return self._wrote(await self.client.create(collection, desired))
            except ApiError as e:
                if e.status != 409:  # created meanwhile: compare it on the next pass
                    raise
                live = await self.client.get(path)
                if live is None:
                    raise
        uid = isvc["metadata"]["uid"]
        if not any(
            ref.get("uid") == uid and ref.get("controller")
            for ref in live["metadata"].get("ownerReferences", [])
        ):
            raise ChildConflict(
                f"{child['kind']} {meta['name']!r} exists and is not controlled by this "
                "InferenceService; delete or rename it"
            )
        patch = apply_patch(live, desired)
        if patch is None:
            return live
        logger.info("updating %s %s/%s", child["kind"], meta["namespace"], meta["name"])
        return self._wrote(await self.client.patch(path, patch))

    async def _prune(self, isvc: Manifest, desired: list[Manifest]) -> None:
        meta = isvc["metadata"]
        wanted = {(c["kind"], c["metadata"]["name"]) for c in desired}
        selector = f"{ISVC_LABEL}={meta['name']},{MANAGED_BY_LABEL}={MANAGER}"
        for kind in PRUNED_KINDS:
            api_version, plural = CHILD_KINDS[kind]
            found = await self.client.list(
                resource_path(api_version, plural, meta["namespace"]), selector
            )
            for obj in found.get("items", []):
                name = obj["metadata"]["name"]
                owned = any(
                    ref.get("uid") == meta["uid"]
                    for ref in obj["metadata"].get("ownerReferences", [])
                )
                if owned and (kind, name) not in wanted:
                    logger.info("deleting %s %s/%s", kind, meta["namespace"], name)
                    await self.client.delete(
                        resource_path(api_version, plural, meta["namespace"], name)
                    )

    async def _write_status(self, isvc: Manifest, status: Manifest) -> None:
        """Writes `status` when it differs, and posts an Event when `Ready` changes reason."""
        old = isvc.get("status") or {}
        if status == old:
            return
        meta = isvc["metadata"]
        patch: Manifest = {"status": {**{k: None for k in old if k not in status}, **status}}
        path = resource_path(crd.API_VERSION, crd.PLURAL, meta["namespace"], meta["name"])
        try:
            self._wrote(await self.client.patch(path + "/status", patch))
        except ApiError as e:
            if e.status == 404:
                return  # deleted meanwhile; its DELETED event drops it
            raise
        before, after = ready_condition(old), ready_condition(status)
        if after is not None and (before is None or before.get("reason") != after.get("reason")):
            kind = "Normal" if after["status"] == "True" else "Warning"
            if after["reason"] == "ComponentsNotReady":
                kind = "Normal"  # starting up or scaling is not a fault
            body = event_body(isvc, kind, after["reason"], after.get("message", ""))
            events = resource_path("v1", "events", meta["namespace"])
            try:
                await self.client.create(events, body)
            except ApiError as e:  # an Event is a courtesy; never fail the pass for it
                logger.warning("could not post an Event for %s: %s", meta["name"], e)
