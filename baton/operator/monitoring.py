"""The scrape object of an `InferenceService`: a Prometheus Operator `PodMonitor` that selects its
engine and router pods and scrapes each one's `/metrics` on its `http` port, labelled with the
pod's pool and service. The operator makes it only where the cluster serves the PodMonitor CRD,
which it learns from API discovery: every account may read that, and a missing CRD is an answer,
not an error. The pods keep their `prometheus.io/*` annotations for annotation-driven scrape
configurations.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from baton.operator.api import Api
from baton.operator.resources import (
    APP,
    COMPONENT_LABEL,
    INSTANCE_LABEL,
    NAME_LABEL,
    labels,
    owner_reference,
)
from baton.operator.spec import InferenceServiceSpec

Manifest = dict[str, Any]

API_VERSION = "monitoring.coreos.com/v1"
KIND = "PodMonitor"
# The engine and router containers both name their metrics port so (pods.py).
METRICS_PORT_NAME = "http"
METRICS_PATH = "/metrics"
# Prometheus durations: "15s", "1m30s", "500ms".
_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
# Target labels from pod labels: `pool` (prefill, decode, engine or router) and
# `inference_service`. Not `role`: the router's per-engine gauges have a `role` label of their
# own, which a target label of that name would push aside (to `exported_role`).
POOL_TARGET_LABEL = "pool"
SERVICE_TARGET_LABEL = "inference_service"


@dataclass(frozen=True)
class PodMonitorConfig:
    """How the operator's PodMonitors scrape (operator flags: the cluster's admin decides)."""

    interval: str = "15s"
    # On every PodMonitor, for a Prometheus whose podMonitorSelector asks for them
    # (kube-prometheus-stack's selects `release: <its release>` by default).
    extra_labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _DURATION.match(self.interval):
            raise ValueError(f"scrape interval {self.interval!r} is not a Prometheus duration")


def pod_monitor_name(name: str) -> str:
    """The PodMonitor of the service `name`."""
    return f"{name}-metrics"


def pod_monitor(isvc: Manifest, spec: InferenceServiceSpec, config: PodMonitorConfig) -> Manifest:
    """The PodMonitor of `isvc`: its pools' pods and its router's, owned by the service."""
    meta = isvc["metadata"]
    name = meta["name"]
    components = [pool.component for pool in spec.pools] + ["router"]
    relabelings = [
        {
            "sourceLabels": [_meta_label(COMPONENT_LABEL)],
            "targetLabel": POOL_TARGET_LABEL,
            "action": "replace",
        },
        {
            "sourceLabels": [_meta_label(INSTANCE_LABEL)],
            "targetLabel": SERVICE_TARGET_LABEL,
            "action": "replace",
        },
    ]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": pod_monitor_name(name),
            "namespace": meta["namespace"],
            "labels": {**config.extra_labels, **labels(name, "monitoring")},
            "ownerReferences": [owner_reference(isvc)],
        },
        "spec": {
            "selector": {
                "matchLabels": {NAME_LABEL: APP, INSTANCE_LABEL: name},
                "matchExpressions": [
                    {"key": COMPONENT_LABEL, "operator": "In", "values": components}
                ],
            },
            "podMetricsEndpoints": [
                {
                    "port": METRICS_PORT_NAME,
                    "path": METRICS_PATH,
                    "interval": config.interval,
                    "relabelings": relabelings,
                }
            ],
        },
    }


def _meta_label(label: str) -> str:
    """The service-discovery meta label Prometheus gives a pod label (`a.b/c` → `a_b_c`)."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)


@dataclass
class ServedKind:
    """Whether the API server serves a kind that a CRD of another project adds (PodMonitors,
    KEDA's ScaledObjects), from discovery; the answer is kept for `recheck_seconds`, as that
    project may be installed (or removed) while the operator runs, and asking on every pass
    would double the calls of a settled one."""

    api: Api
    api_version: str
    kind: str
    recheck_seconds: float = 300.0
    _served: bool = False
    _asked_at: float | None = None

    async def served(self) -> bool:
        now = time.monotonic()
        if self._asked_at is None or now - self._asked_at >= self.recheck_seconds:
            self._served = await self.api.serves(self.api_version, self.kind)
            self._asked_at = now
        return self._served
