"""The `InferenceService` status from what really runs: per pool the desired, ready, updated and
available replicas, the pods' revision label and whether its rollout is complete; the endpoint
URL (and the gateway's); and the conditions `Ready`, `PrefillReady`, `DecodeReady`,
`RouterReady`, `RolloutComplete`, `ModelNameConflict` (and the canary's `KVPathReady`) with
CamelCase reasons, `observedGeneration` and transition times that move only when a condition's
status changes. Pure functions; the reconciler reads the children and writes the result.
"""

from __future__ import annotations

import datetime
from typing import Any

from baton.operator.revision import REVISION_LABEL, revision
from baton.operator.spec import InferenceServiceSpec

Manifest = dict[str, Any]
# The reason of a Deployment's `Progressing=False` condition once it stopped making progress.
PROGRESS_DEADLINE = "ProgressDeadlineExceeded"


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pool_status(deployment: Manifest | None) -> Manifest:
    """Replicas of one Deployment as its controller reports them (all 0 while it does not exist),
    whether its rollout is complete, and its pods' revision label when they have one."""
    spec = (deployment or {}).get("spec", {})
    desired = 0 if deployment is None else spec.get("replicas", 1)
    live = (deployment or {}).get("status") or {}
    ready = live.get("readyReplicas", 0) or 0
    result: Manifest = {
        "desiredReplicas": desired,
        "readyReplicas": ready,
        "summary": f"{ready}/{desired}",
        "replicas": live.get("replicas", 0) or 0,
        "updatedReplicas": live.get("updatedReplicas", 0) or 0,
        "availableReplicas": live.get("availableReplicas", 0) or 0,
        "rolloutComplete": rollout_waiting(deployment) is None,
    }
    template = spec.get("template", {}).get("metadata", {})
    label = (template.get("labels") or {}).get(REVISION_LABEL)
    if label is not None:
        result["revision"] = label
    return result


def rollout_waiting(deployment: Manifest | None) -> tuple[str, str] | None:
    """What a Deployment's rollout waits for, as (reason, message), or None when it is complete.
    The rule is `kubectl rollout status`'s: the controller has observed the current generation,
    its progress deadline has not passed, and every wanted pod is updated and available with no
    old pod left."""
    if deployment is None:
        return "RolloutInProgress", "no Deployment yet"
    generation = deployment.get("metadata", {}).get("generation", 0) or 0
    live = deployment.get("status") or {}
    if (live.get("observedGeneration", 0) or 0) < generation:
        return "RolloutInProgress", f"generation {generation} not observed yet"
    for cond in live.get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == PROGRESS_DEADLINE:
            return PROGRESS_DEADLINE, "exceeded its progress deadline"
    desired = deployment.get("spec", {}).get("replicas", 1)
    replicas = live.get("replicas", 0) or 0
    updated = live.get("updatedReplicas", 0) or 0
    available = live.get("availableReplicas", 0) or 0
    if updated < desired:
        return "RolloutInProgress", f"{updated} of {desired} replicas updated"
    if replicas > updated:
        return "RolloutInProgress", f"{replicas - updated} old replicas pending termination"
    if available < updated:
        return "RolloutInProgress", f"{available} of {updated} updated replicas available"
    return None


def rollout_condition(
    deployments: dict[str, Manifest | None], components: tuple[str, ...], want: str, generation: int
) -> Manifest:
    """`RolloutComplete`: True once every Deployment of `components` has rolled out and the
    engine pools' pods carry the revision `want`; else which pool waits for what."""
    waiting: list[tuple[str, str, str]] = []
    for component in components:
        deployment = deployments.get(component)
        found = rollout_waiting(deployment)
        label = pool_status(deployment).get("revision")
        if found is None and component != "router" and label != want:
            # Only until this pass's apply lands; the Deployment's own status then takes over.
            found = "RolloutInProgress", f"pods of revision {label}, the spec wants {want}"
        if found is not None:
            waiting.append((component, *found))
    if not waiting:
        message = f"every pod is updated; engines run revision {want}"
        return condition("RolloutComplete", True, "RolloutComplete", message, generation)
    reasons = {reason for _, reason, _ in waiting}
    reason = PROGRESS_DEADLINE if PROGRESS_DEADLINE in reasons else "RolloutInProgress"
    message = "; ".join(f"{component}: {what}" for component, _, what in waiting)
    return condition("RolloutComplete", False, reason, f"to revision {want}: {message}", generation)


def condition(kind: str, ok: bool, reason: str, message: str, generation: int) -> Manifest:
    return {
        "type": kind,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def _pool_condition(kind: str, pool: Manifest, generation: int, what: str) -> Manifest:
    ready, desired = pool["readyReplicas"], pool["desiredReplicas"]
    if ready > 0:
        reason = "ReplicasReady" if ready >= desired else "PartiallyReady"
        return condition(kind, True, reason, f"{ready}/{desired} {what} pods ready", generation)
    if desired == 0:
        return condition(kind, False, "ScaledToZero", f"no {what} pods are wanted", generation)
    return condition(kind, False, "NoReplicasReady", f"0/{desired} {what} pods ready", generation)


def merge_conditions(old: list[Manifest], new: list[Manifest], now: str) -> list[Manifest]:
    """`new` with the transition times of `old` kept where the status did not change."""
    previous = {c.get("type"): c for c in old}
    merged = []
    for cond in new:
        before = previous.get(cond["type"])
        same = before is not None and before.get("status") == cond["status"]
        since = before.get("lastTransitionTime", now) if same and before else now
        merged.append({**cond, "lastTransitionTime": since})
    return merged


def running_status(
    isvc: Manifest,
    spec: InferenceServiceSpec,
    deployments: dict[str, Manifest | None],
    url: str,
    now: str,
    model_owner: str | None = None,
    kv_ready: Manifest | None = None,
    kv_path: Manifest | None = None,
    gateway_url: str | None = None,
) -> Manifest:
    """Status of a valid spec; `deployments` maps component ("prefill", "decode", "engine",
    "router") to the live Deployment or None; `model_owner` is the "namespace/name" of an
    earlier service that serves the same model name, if any; `kv_ready` and `kv_path` the
    canary's `KVPathReady` and `kvPath` (None: no canary; both are left out); `gateway_url`
    the cluster gateway's, which serves the model too unless another service holds its name."""
    generation = isvc["metadata"].get("generation", 0)
    # One pool does both jobs when aggregated, so it stands for prefill and for decode alike.
    aggregated = spec.mode == "aggregated"
    prefill_pool, decode_pool = ("engine", "engine") if aggregated else ("prefill", "decode")
    prefill = pool_status(deployments.get(prefill_pool))
    decode = pool_status(deployments.get(decode_pool))
    router = pool_status(deployments.get("router"))
    want = revision(spec)
    components = ("engine", "router") if aggregated else ("prefill", "decode", "router")
    parts = [
        _pool_condition("PrefillReady", prefill, generation, prefill_pool),
        _pool_condition("DecodeReady", decode, generation, decode_pool),
        _pool_condition("RouterReady", router, generation, "router"),
    ]
    # KEDA wakes a pool that may scale to zero when the router holds a request for it, so such
    # a pool at zero is asleep, not missing.
    wakes = {p.component for p in spec.pools if p.autoscaling and p.autoscaling.min_replicas == 0}
    pool_of = {"PrefillReady": prefill_pool, "DecodeReady": decode_pool, "RouterReady": "router"}
    asleep = sorted({pool_of[c["type"]] for c in parts if c["reason"] == "ScaledToZero"} & wakes)
    waiting = [
        c["type"] for c in parts if c["status"] != "True" and pool_of[c["type"]] not in asleep
    ]
    if waiting:
        ready = condition(
            "Ready", False, "ComponentsNotReady", "waiting for " + ", ".join(waiting), generation
        )
    else:
        at = f"serving at {url}"
        if gateway_url and model_owner is None:
            at += f" and at {gateway_url} as model {spec.model.served_model_name!r}"
        if asleep:
            at += f"; {' and '.join(asleep)} at zero until a request wakes it"
        ready = condition("Ready", True, "AllComponentsReady", at, generation)
    old = {k: v for k, v in isvc.get("status", {}).items() if k not in ("kvPath", "gatewayUrl")}
    extra: Manifest = {}
    if kv_path is not None:
        extra["kvPath"] = kv_path
    if gateway_url and model_owner is None:
        extra["gatewayUrl"] = gateway_url
    return {
        **old,
        **extra,
        "observedGeneration": generation,
        "mode": spec.mode,
        "url": url,
        "revision": want,
        "prefill": prefill,
        "decode": decode,
        "router": router,
        "conditions": merge_conditions(
            old.get("conditions", []),
            [
                ready,
                *parts,
                rollout_condition(deployments, components, want, generation),
                model_name_condition(spec, model_owner, generation),
                *([kv_ready] if kv_ready is not None else []),
            ],
            now,
        ),
    }


def model_name_condition(
    spec: InferenceServiceSpec, model_owner: str | None, generation: int
) -> Manifest:
    """`ModelNameConflict`: True while an earlier service holds the served model name; the
    gateway then leaves this one out (its own router still serves it)."""
    served = spec.model.served_model_name
    if model_owner is None:
        message = f"the gateway serves {served!r} here"
        return condition("ModelNameConflict", False, "ModelNameUnique", message, generation)
    message = (
        f"{model_owner} was created earlier and serves {served!r}; the gateway does not route "
        "to this service; set spec.model.servedModelName to another name"
    )
    return condition("ModelNameConflict", True, "ServedModelNameTaken", message, generation)


def failed_status(isvc: Manifest, reason: str, message: str, now: str) -> Manifest:
    """Status of a spec that cannot be served or applied: `Ready=False` with the reason; the other
    conditions stay as they were (whatever ran before keeps running)."""
    generation = isvc["metadata"].get("generation", 0)
    old = isvc.get("status", {})
    ready = condition("Ready", False, reason, message, generation)
    kept = [c for c in old.get("conditions", []) if c.get("type") != "Ready"]
    return {
        **old,
        "observedGeneration": generation,
        "conditions": merge_conditions(old.get("conditions", []), [ready, *kept], now),
    }


def ready_condition(status: Manifest, kind: str = "Ready") -> Manifest | None:
    """The condition `kind` (default `Ready`) of `status`, if it has one."""
    for cond in status.get("conditions", []):
        if cond.get("type") == kind:
            return dict(cond)
    return None
