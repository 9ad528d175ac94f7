"""Kubernetes Events about an `InferenceService` (what `kubectl describe` shows)."""

from __future__ import annotations

import socket
from typing import Any

from baton.operator.status import now_iso

COMPONENT = "baton-operator"


def event_body(involved: dict[str, Any], kind: str, reason: str, message: str) -> dict[str, Any]:
    """A core/v1 Event about `involved`; `kind` is "Normal" or "Warning"."""
    meta = involved["metadata"]
    now = now_iso()
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": involved.get("apiVersion", ""),
            "kind": involved.get("kind", ""),
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid", ""),
            "resourceVersion": meta.get("resourceVersion", ""),
        },
        "type": kind,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": socket.gethostname(),
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
