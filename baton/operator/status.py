"""The `InferenceService` status from what really runs: ready and desired replicas per role, the
endpoint URL, and the conditions `Ready`, `PrefillReady`, `DecodeReady`, `RouterReady`,
`ModelNameConflict` with
CamelCase reasons, `observedGeneration` and transition times that move only when a condition's
status changes. Pure functions; the reconciler reads the children and writes the result.
"""

from __future__ import annotations

import datetime
from typing import Any

from baton.operator.spec import InferenceServiceSpec

Manifest = dict[str, Any]


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pool_status(deployment: Manifest | None) -> Manifest:
    """Desired and ready replicas of one Deployment (0/0 while it does not exist)."""
    if deployment is None:
        return {"desiredReplicas": 0, "readyReplicas": 0, "summary": "0/0"}
    desired = deployment.get("spec", {}).get("replicas", 1)
    ready = deployment.get("status", {}).get("readyReplicas", 0) or 0
    return {"desiredReplicas": desired, "readyReplicas": ready, "summary": f"{ready}/{desired}"}


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
) -> Manifest:
    """Status of a valid spec; `deployments` maps component ("prefill", "decode", "engine",
    "router") to the live Deployment or None; `model_owner` is the "namespace/name" of an
    earlier service that serves the same model name, if any."""
    generation = isvc["metadata"].get("generation", 0)
    # One pool does both jobs when aggregated, so it stands for prefill and for decode alike.
    aggregated = spec.mode == "aggregated"
    prefill_pool, decode_pool = ("engine", "engine") if aggregated else ("prefill", "decode")
    prefill = pool_status(deployments.get(prefill_pool))
    decode = pool_status(deployments.get(decode_pool))
    router = pool_status(deployments.get("router"))
    parts = [
        _pool_condition("PrefillReady", prefill, generation, prefill_pool),
        _pool_condition("DecodeReady", decode, generation, decode_pool),
        _pool_condition("RouterReady", router, generation, "router"),
    ]
    waiting = [c["type"] for c in parts if c["status"] != "True"]
    if waiting:
        ready = condition(
            "Ready", False, "ComponentsNotReady", "waiting for " + ", ".join(waiting), generation
        )
    else:
        ready = condition("Ready", True, "AllComponentsReady", f"serving at {url}", generation)
    old = isvc.get("status", {})
    return {
        **old,
        "observedGeneration": generation,
        "mode": spec.mode,
        "url": url,
        "prefill": prefill,
        "decode": decode,
        "router": router,
        "conditions": merge_conditions(
            old.get("conditions", []),
            [ready, *parts, model_name_condition(spec, model_owner, generation)],
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
        return condition(
            "ModelNameConflict",
            False,
            "ModelNameUnique",
            f"the gateway serves {served!r} here",
            generation,
        )
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
