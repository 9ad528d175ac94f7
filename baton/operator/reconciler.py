"""Level-triggered reconciliation of one `InferenceService`: read it, build every desired child
with the pure builders, server-side apply each one that is not as desired, delete children it no
longer wants, and write the status from what the API reports, all from scratch on every pass.
Whatever triggers a pass (a change to the service, to a child, a retry, a resync), the outcome
depends only on the current state. One child is the exception to applying: the hand-off Secret
is created once and never written again (its user rotates it by editing it).

Triggers for one service coalesce: while a pass runs, further triggers mark it dirty and one
more pass follows, so a burst of child events costs at most one extra pass. A pass that fails
on the API is retried with exponential backoff; a bad spec is not retried (its next edit
triggers a pass) and shows as `Ready=False` with a reason and a Warning Event.

A served model name belongs to the earliest service (by creationTimestamp) that asks for it
among the namespaces the operator watches; a later one gets `ModelNameConflict=True`, a Warning
Event, and engine Services without the gateway's label, so the gateway never merges two
tenants' engines into one model's pool.

Where the cluster serves the Prometheus Operator's PodMonitor, each service also gets one
(`monitoring.py`), applied like any child but not watched: a watch of a kind the cluster may
not serve would fail, so a PodMonitor edited or deleted by hand is put back by the service's
next pass (the periodic resync at the latest).

A pool with `autoscaling.engine: keda` gets a KEDA ScaledObject instead of an HPA, applied and
not watched for the same reason. Where the cluster does not serve ScaledObjects, such a spec is
refused like a bad one (`KEDANotInstalled`) and whatever ran before keeps running. Unwanted
autoscalers (a pool turned from one engine to the other, or off) are deleted before the
children are applied: KEDA's admission webhook refuses a ScaledObject for a Deployment that
another HPA scales, and two autoscalers must not fight over one Deployment meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.dynamic.exceptions import ConflictError, NotFoundError

from baton.kube import ISVC_LABEL, MANAGED_BY_LABEL
from baton.operator import crd
from baton.operator.api import Api
from baton.operator.canary import Canary, CanaryConfig, Target, kv_path, kv_path_ready
from baton.operator.events import event_body
from baton.operator.monitoring import API_VERSION as POD_MONITOR_API_VERSION
from baton.operator.monitoring import KIND as POD_MONITOR_KIND
from baton.operator.monitoring import PodMonitorConfig, ServedKind, pod_monitor
from baton.operator.pods import KV_SECRET_KEY
from baton.operator.resources import (
    COMPONENT_LABEL,
    DEFAULT_PROMETHEUS_ADDRESS,
    KEDA_API_VERSION,
    MANAGER,
    NetworkAccess,
    desired_children,
    fresh_kv_secret_data,
    service_url,
)
from baton.operator.revision import revision
from baton.operator.spec import InferenceServiceSpec, parse_spec
from baton.operator.status import failed_status, now_iso, ready_condition, running_status
from baton.operator.validation import SpecError

logger = logging.getLogger(__name__)

Manifest = dict[str, Any]
Key = tuple[str, str]  # namespace, name

# Kind -> apiVersion of every kind of child.
CHILD_KINDS: dict[str, str] = {
    "Deployment": "apps/v1",
    "Service": "v1",
    "HorizontalPodAutoscaler": "autoscaling/v2",
    "PodDisruptionBudget": "policy/v1",
    "ServiceAccount": "v1",
    "Role": "rbac.authorization.k8s.io/v1",
    "RoleBinding": "rbac.authorization.k8s.io/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
}
# The hand-off Secret is created once, never applied, and not watched: a watch of Secrets needs
# list and watch on them, which would hand the operator every Secret's value; a deleted one is
# made again by the next pass (a resync at the latest).
# Kinds of which a spec change can leave children behind (a mode switch, autoscaling off).
PRUNED_KINDS = ("Deployment", "Service", "PodDisruptionBudget")
# The same for autoscalers, deleted before anything is applied (module docstring).
HPA_KINDS = {"HorizontalPodAutoscaler": CHILD_KINDS["HorizontalPodAutoscaler"]}
KEDA_KINDS = {"ScaledObject": KEDA_API_VERSION}
# The field manager that keeps a Deployment's `spec.replicas` while an autoscaler (or the
# planner) takes it over.
HANDOFF_MANAGER = "baton-operator-handoff"
# `KVPathReady` reasons worth a Warning Event when they begin.
KV_FAULTS = ("CanaryHandOffFailed", "IncompatibleEngines", "TransportFellBack")


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
    """Reconciles `InferenceService`s through `api`; one instance per operator process."""

    api: Api
    default_image: str = ""
    max_backoff: float = 60.0
    default_gpu_image: str = ""  # for pools that ask for GPUs; "" means default_image
    access: NetworkAccess = field(default_factory=NetworkAccess)
    # Where rivals for a served model name are looked for: the watched namespaces (empty: all).
    namespaces: tuple[str, ...] = ()
    _states: dict[Key, _KeyState] = field(default_factory=dict)
    # Service -> the earlier service that holds its served model name; when that one goes,
    # the later ones are reconciled at once to take the name over.
    _model_owners: dict[Key, Key] = field(default_factory=dict)
    # Generation of each service whose children this process has applied in full and pruned.
    # Only a spec change (or a new operator) can make a child unwanted or drop a field from it,
    # so after that first pass a child is applied only when it lost a desired value, and the
    # lists that pruning needs run once per generation, not once per pass.
    _settled: dict[Key, tuple[int, Key | None]] = field(default_factory=dict)
    # (kind, namespace, name) -> resourceVersion of the operator's own last write, so that the
    # watch event of that write does not trigger another pass (controller-runtime calls these
    # "expectations"). Any other version, or a deletion, still triggers one.
    _written: dict[tuple[str, str, str], str] = field(default_factory=dict)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    # None: no KV path canary (and no `KVPathReady`).
    canary: CanaryConfig | None = None
    # The cluster gateway's URL, said in the status of every service it serves (None: none).
    gateway_url: str | None = None
    # None: no PodMonitors; otherwise one per service where the cluster serves the kind.
    monitoring: PodMonitorConfig | None = None
    # Where ScaledObjects query Prometheus unless their pool says (--prometheus-address).
    prometheus_address: str = DEFAULT_PROMETHEUS_ADDRESS
    _canary: Canary | None = field(default=None, init=False)
    _pod_monitors: ServedKind | None = field(default=None, init=False)
    _scaled_objects: ServedKind = field(init=False)

    def __post_init__(self) -> None:
        if self.canary is not None:
            self._canary = Canary(self.api, self.canary, self.trigger)
        if self.monitoring is not None:
            self._pod_monitors = ServedKind(self.api, POD_MONITOR_API_VERSION, POD_MONITOR_KIND)
        self._scaled_objects = ServedKind(self.api, KEDA_API_VERSION, "ScaledObject")

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
        if self._canary is not None:
            self._canary.forget((namespace, name))
        self._settled.pop((namespace, name), None)
        self._model_owners.pop((namespace, name), None)
        state = self._states.pop((namespace, name), None)
        if state is not None and state.retry is not None:
            state.retry.cancel()
        for later, owner in list(self._model_owners.items()):
            if owner == (namespace, name):
                del self._model_owners[later]
                self._spawn(later)

    async def close(self) -> None:
        for state in self._states.values():
            if state.retry is not None:
                state.retry.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self._canary is not None:
            await self._canary.close()

    async def _attempt(self, key: Key, state: _KeyState) -> None:
        if state.retry is not None:
            state.retry.cancel()
            state.retry = None
        try:
            await self.reconcile(*key)
            state.failures = 0
        except (ApiException, aiohttp.ClientError, TimeoutError, ChildConflict) as e:
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
        isvc = await self.api.get(crd.API_VERSION, crd.KIND, namespace, name)
        if isvc is None or isvc["metadata"].get("deletionTimestamp"):
            self.forget(namespace, name)
            return
        try:
            spec = parse_spec(isvc.get("spec"), self.default_image, self.default_gpu_image)
            owner = await self._model_owner(isvc, spec)
            desired = desired_children(
                isvc, spec, self.access, owner is None, self.prometheus_address
            )
        except SpecError as e:
            await self._write_status(isvc, failed_status(isvc, e.reason, e.message, now_iso()))
            return
        keda = [c["metadata"]["name"] for c in desired if c["kind"] == "ScaledObject"]
        if keda and not await self._scaled_objects.served():
            message = (
                f"autoscaling.engine keda ({', '.join(keda)}) needs KEDA, and the cluster does "
                f"not serve ScaledObjects ({KEDA_API_VERSION}); install KEDA, or set "
                "autoscaling.engine: hpa"
            )
            await self._write_status(
                isvc, failed_status(isvc, "KEDANotInstalled", message, now_iso())
            )
            return
        monitors = self._pod_monitors
        if self.monitoring is not None and monitors is not None and await monitors.served():
            desired.append(pod_monitor(isvc, spec, self.monitoring))
        if owner is None:
            self._model_owners.pop((namespace, name), None)
        else:
            self._model_owners[(namespace, name)] = owner
        generation = isvc["metadata"].get("generation", 0)
        # Losing or winning the model name changes the Services without a new generation.
        settled = self._settled.get((namespace, name)) == (generation, owner)
        # Before the Deployments: a pod whose Secret is missing waits with FailedMount events.
        for child in desired:
            if child["kind"] == "Secret":
                await self._ensure_kv_secret(child)
        to_apply = [child for child in desired if child["kind"] != "Secret"]
        if not settled:
            await self._prune(isvc, desired, await self._autoscaler_kinds())
        try:
            applied = await asyncio.gather(
                *(self._apply(isvc, child, settled) for child in to_apply)
            )
        except ChildConflict as e:
            await self._write_status(isvc, failed_status(isvc, "ChildConflict", str(e), now_iso()))
            raise
        if not settled:
            await self._prune(isvc, desired, {kind: CHILD_KINDS[kind] for kind in PRUNED_KINDS})
            self._settled[(namespace, name)] = (generation, owner)
        deployments: dict[str, Manifest | None] = {}
        router_service = None
        for child, live in zip(to_apply, applied, strict=True):
            if child["kind"] == "Deployment":
                deployments[child["metadata"]["labels"][COMPONENT_LABEL]] = live
            elif child["kind"] == "Service" and child["metadata"]["name"] == name:
                router_service = live
        url = service_url(isvc, router_service)
        holder = f"{owner[0]}/{owner[1]}" if owner else None
        kv_ready, kv = self._kv_status(isvc, spec, deployments)
        status = running_status(
            isvc, spec, deployments, url, now_iso(), holder, kv_ready, kv, self.gateway_url
        )
        await self._write_status(isvc, status)

    def _kv_status(
        self, isvc: Manifest, spec: InferenceServiceSpec, deployments: dict[str, Manifest | None]
    ) -> tuple[Manifest | None, Manifest | None]:
        """Starts, keeps or stops the service's canary; `KVPathReady` and `kvPath` from its
        last check (both None without a canary or in aggregated mode)."""
        meta = isvc["metadata"]
        key = (meta["namespace"], meta["name"])
        if self._canary is None or spec.mode != "disaggregated":
            if self._canary is not None:
                self._canary.forget(key)
            return None, None
        ready = all(
            ((deployments.get(pool) or {}).get("status") or {}).get("readyReplicas", 0)
            for pool in ("prefill", "decode")
        )
        target = Target(
            *key,
            spec.model.served_model_name,
            spec.kv_transfer.transport,
            spec.api_key_secret,
            revision(spec),
        )
        self._canary.watch(key, target if ready else None)
        old = isvc.get("status") or {}
        check = self._canary.last(key)
        generation = meta.get("generation", 0)
        condition = kv_path_ready(check, ready, ready_condition(old, "KVPathReady"), generation)
        return condition, kv_path(check, old.get("kvPath"))

    async def _model_owner(self, isvc: Manifest, spec: InferenceServiceSpec) -> Key | None:
        """The earliest other service (creationTimestamp, then namespace and name, so every
        pass agrees) asking for `isvc`'s served model name, or None when `isvc` is first."""
        served = spec.model.served_model_name
        first = _age(isvc)
        owner: Key | None = None
        for namespace in self.namespaces or (None,):
            for rival in await self.api.list(crd.API_VERSION, crd.KIND, namespace):
                meta = rival["metadata"]
                if meta.get("uid") == isvc["metadata"]["uid"] or meta.get("deletionTimestamp"):
                    continue
                if _age(rival) < first and _served_name(rival, self.default_image) == served:
                    first, owner = _age(rival), (meta["namespace"], meta["name"])
        return owner

    async def _apply(self, isvc: Manifest, child: Manifest, settled: bool) -> Manifest:
        """Server-side applies one child (which creates it when missing) unless the service is
        `settled` and the child still has every desired value; returns it as the API server
        holds it. Applying with force takes back whatever someone else changed; a field the
        operator stopped setting is removed by the server, as the operator owned it."""
        meta = child["metadata"]
        what = (child["kind"], meta["namespace"], meta["name"])
        live = await self.api.get(child["apiVersion"], child["kind"], *what[1:])
        if live is not None:
            if not controlled_by(live, isvc["metadata"]["uid"]):
                raise ChildConflict(
                    f"{child['kind']} {meta['name']!r} exists and is not controlled by this "
                    "InferenceService; delete or rename it"
                )
            if settled and contains(live, child):
                return live
            await self._hand_off_replicas(live, child)
        logger.info("applying %s %s/%s", *what)
        return self._wrote(await self.api.apply(child, MANAGER, force=True))

    async def _ensure_kv_secret(self, child: Manifest) -> None:
        """Creates the hand-off Secret `child` with a fresh secret when no Secret has its name.
        A plain create rather than an apply: applied, the key file would be a field this manager
        owns, and a later apply that left it out (to keep a user's rotation) would remove it.
        One that exists, whoever made it, is used as it is."""
        meta = child["metadata"]
        live = await self.api.get(
            child["apiVersion"], child["kind"], meta["namespace"], meta["name"]
        )
        if live is None:
            logger.info("creating %s %s/%s", child["kind"], meta["namespace"], meta["name"])
            # A 409: made meanwhile (by another pass or by its user); that one stands.
            with contextlib.suppress(ConflictError):
                await self.api.create({**child, "data": fresh_kv_secret_data()}, MANAGER)
        elif KV_SECRET_KEY not in (live.get("data") or {}):
            logger.warning(
                "Secret %s/%s has no %r key; the engine pods that mount it cannot start",
                meta["namespace"],
                meta["name"],
                KV_SECRET_KEY,
            )

    async def _hand_off_replicas(self, live: Manifest, child: Manifest) -> None:
        """Keeps a Deployment's replicas when its pool turns to autoscaling or the planner. The
        operator stops applying `spec.replicas` then, and a field its manager alone owns would
        be removed (the Deployment back to 1 replica) before the autoscaler writes it; another
        manager applying the live value first keeps it until the autoscaler takes it over."""
        if child["kind"] != "Deployment" or "replicas" in child.get("spec", {}):
            return
        replicas = live.get("spec", {}).get("replicas")
        if replicas is None or not owns(live, MANAGER, ("f:spec", "f:replicas")):
            return
        meta = child["metadata"]
        keep = {
            "apiVersion": child["apiVersion"],
            "kind": child["kind"],
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            "spec": {"replicas": replicas},
        }
        logger.info("handing replicas of %s/%s over", meta["namespace"], meta["name"])
        await self.api.apply(keep, HANDOFF_MANAGER, force=False)

    async def _autoscaler_kinds(self) -> dict[str, str]:
        """The autoscaler kinds a service may have left behind: ScaledObjects only where the
        cluster serves them (listing them elsewhere is a 404)."""
        if await self._scaled_objects.served():
            return HPA_KINDS | KEDA_KINDS
        return HPA_KINDS

    async def _prune(self, isvc: Manifest, desired: list[Manifest], kinds: dict[str, str]) -> None:
        """Deletes the service's children of `kinds` (kind -> apiVersion) that are not
        `desired`."""
        meta = isvc["metadata"]
        wanted = {(c["kind"], c["metadata"]["name"]) for c in desired}
        selector = f"{ISVC_LABEL}={meta['name']},{MANAGED_BY_LABEL}={MANAGER}"
        for kind, api_version in kinds.items():
            found = await self.api.list(api_version, kind, meta["namespace"], selector)
            for obj in found:
                name = obj["metadata"]["name"]
                owned = any(
                    ref.get("uid") == meta["uid"]
                    for ref in obj["metadata"].get("ownerReferences", [])
                )
                if owned and (kind, name) not in wanted:
                    logger.info("deleting %s %s/%s", kind, meta["namespace"], name)
                    await self.api.delete(api_version, kind, meta["namespace"], name)

    async def _write_status(self, isvc: Manifest, status: Manifest) -> None:
        """Writes `status` when it differs, and posts an Event when `Ready` changes reason."""
        old = isvc.get("status") or {}
        if status == old:
            return
        meta = isvc["metadata"]
        patch: Manifest = {"status": {**{k: None for k in old if k not in status}, **status}}
        try:
            self._wrote(await self.api.patch_status(isvc, patch))
        except NotFoundError:
            return  # deleted meanwhile; its DELETED event drops it
        events: list[tuple[str, str, str]] = []
        before, after = ready_condition(old), ready_condition(status)
        if after is not None and (before is None or before.get("reason") != after.get("reason")):
            kind = "Normal" if after["status"] == "True" else "Warning"
            if after["reason"] == "ComponentsNotReady":
                kind = "Normal"  # starting up or scaling is not a fault
            events.append((kind, after["reason"], after.get("message", "")))
        kv_before = ready_condition(old, "KVPathReady") or {}
        kv_after = ready_condition(status, "KVPathReady") or {}
        if kv_after.get("reason") in KV_FAULTS and kv_before.get("reason") != kv_after["reason"]:
            events.append(("Warning", kv_after["reason"], kv_after.get("message", "")))
        conflict = ready_condition(status, "ModelNameConflict")
        if conflict and conflict["status"] == "True":
            was = ready_condition(old, "ModelNameConflict")
            if was is None or was.get("status") != "True":
                events.append(("Warning", "ModelNameConflict", conflict.get("message", "")))
        for kind, reason, message in events:
            try:
                await self.api.create(event_body(isvc, kind, reason, message))
            except ApiException as e:  # an Event is a courtesy; never fail the pass for it
                logger.warning("could not post an Event for %s: %s", meta["name"], e)


def _age(isvc: Manifest) -> tuple[str, str, str]:
    meta = isvc["metadata"]
    # RFC 3339 UTC timestamps of one format sort as strings.
    return meta.get("creationTimestamp", ""), meta.get("namespace", ""), meta["name"]


def _served_name(isvc: Manifest, default_image: str) -> str | None:
    """The model name a service serves, or None when its spec cannot run (it serves nothing)."""
    try:
        return parse_spec(isvc.get("spec"), default_image).model.served_model_name
    except SpecError:
        return None


def controlled_by(obj: Manifest, uid: str) -> bool:
    """Whether `obj`'s controller owner reference is the object with `uid`."""
    return any(
        ref.get("uid") == uid and ref.get("controller")
        for ref in obj["metadata"].get("ownerReferences", [])
    )


def owns(obj: Manifest, manager: str, path: tuple[str, ...]) -> bool:
    """Whether `manager` applied the field at `path` (in `managedFields` notation, such as
    `("f:spec", "f:replicas")`) of `obj`."""
    for entry in obj.get("metadata", {}).get("managedFields") or []:
        if entry.get("manager") != manager or entry.get("operation") != "Apply":
            continue
        node = entry.get("fieldsV1") or {}
        for segment in path:
            node = node.get(segment) if isinstance(node, dict) else None
        if node is not None:
            return True
    return False


def contains(live: Any, desired: Any) -> bool:
    """Whether `live` has every field of `desired` (extra fields in `live` are defaults or
    belong to someone else); lists must match element by element."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            key in live and contains(live[key], value) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(contains(a, b) for a, b in zip(live, desired, strict=True))
        )
    if isinstance(desired, int | float) and not isinstance(desired, bool) and isinstance(live, str):
        return str(desired) == live  # the API server turns quantities like 2 into "2"
    return bool(live == desired)
