"""The PodMonitor of each InferenceService against the emulated API server: made where the
cluster serves the kind, selecting exactly the service's engine and router pods by their labels
and port names, owned by the service, kept in step with its spec; nothing (and no error) where
the kind is not served."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from baton.kube import connect
from baton.operator import monitoring
from baton.operator.api import Api
from baton.operator.monitoring import PodMonitorConfig
from baton.operator.reconciler import Reconciler
from baton.operator.status import ready_condition
from tests.operator.conftest import Kube, wait_for

NS = "serving"
MONITOR = f"/apis/monitoring.coreos.com/v1/namespaces/{NS}/podmonitors/llama-metrics"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
SPEC: dict[str, Any] = {"model": {"uri": "hf://acme/llama-8b"}, "image": "b:1"}
CONFIG = PodMonitorConfig("30s", {"release": "kube-prometheus-stack"})


def declare_pod_monitors(kube: Kube) -> None:
    """Installs the PodMonitor kind, as the Prometheus Operator's CRD does."""
    kube.server.declare(
        "monitoring.coreos.com", "v1", "podmonitors", "PodMonitor", True, ("status",)
    )
    wait_for(lambda: kube.http.get("/apis/monitoring.coreos.com/v1").status_code == 200)


def run(
    kube: Kube,
    tmp_path: Path,
    body: Callable[[Reconciler], Awaitable[None]],
    recheck_seconds: float = 300.0,
) -> None:
    """Runs `body` with a reconciler that makes PodMonitors, connected to `kube`."""

    async def main() -> None:
        cluster = await connect(str(kube.server.write_kubeconfig(tmp_path / "kubeconfig")))
        try:
            reconciler = Reconciler(Api(cluster), monitoring=CONFIG)
            assert reconciler._pod_monitors is not None
            reconciler._pod_monitors.recheck_seconds = recheck_seconds
            await body(reconciler)
        finally:
            await cluster.close()

    asyncio.run(main())


def reconcile_once(kube: Kube, tmp_path: Path) -> None:
    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")

    run(kube, tmp_path, body)


def selects(selector: dict[str, Any], pod_labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels, matchExpressions with In) selects `pod_labels`."""
    if any(pod_labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        if pod_labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def meta_label(label: str) -> str:
    """Prometheus' service-discovery name of a pod label, as its documentation gives it."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)


def pod_templates(kube: Kube) -> dict[str, dict[str, Any]]:
    """Deployment name -> its pod template."""
    found = kube.get(DEPLOYMENTS) or {}
    return {d["metadata"]["name"]: d["spec"]["template"] for d in found["items"]}


def scraped(kube: Kube, monitor: dict[str, Any]) -> dict[str, list[str]]:
    """Deployment name -> the ports named by the monitor's endpoints that its pods serve, for
    every Deployment whose pods the monitor selects."""
    names = [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]]
    result = {}
    for deployment, template in pod_templates(kube).items():
        if selects(monitor["spec"]["selector"], template["metadata"]["labels"]):
            ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
            result[deployment] = [n for n in names if n in ports]
    return result


def test_a_service_gets_a_pod_monitor_of_its_engines_and_router(kube: Kube, tmp_path: Path) -> None:
    """With the kind served, a disaggregated service gets one PodMonitor, owned by it, that
    selects its prefill, decode and router pods and no one else's, scrapes /metrics on a port
    each of them names, at the configured interval, with the configured labels; deleting the
    service deletes it."""
    declare_pod_monitors(kube)
    uid = kube.apply_isvc(NS, "llama", SPEC)["metadata"]["uid"]
    kube.apply_isvc(NS, "other", SPEC | {"model": {"uri": "hf://acme/other"}})

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")
        await reconciler.reconcile(NS, "other")

    run(kube, tmp_path, body)
    monitor = kube.get(MONITOR)
    assert monitor is not None
    (owner,) = monitor["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "InferenceService",
        "llama",
        uid,
        True,
    )
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert scraped(kube, monitor) == {
        "llama-prefill": ["http"],
        "llama-decode": ["http"],
        "llama-router": ["http"],
    }
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["path"], endpoint["interval"]) == ("/metrics", "30s")
    # The target labels come from labels every selected pod carries.
    targets = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    for template in pod_templates(kube).values():
        pod_labels = {meta_label(k): v for k, v in template["metadata"]["labels"].items()}
        if selects(monitor["spec"]["selector"], template["metadata"]["labels"]):
            assert {name: pod_labels.get(source) for name, (source,) in targets.items()} == {
                "pool": template["metadata"]["labels"]["app.kubernetes.io/component"],
                "inference_service": "llama",
            }
    assert kube.names("podmonitors", NS) == {"llama-metrics", "other-metrics"}
    kube.delete(f"/apis/baton.dev/v1alpha1/namespaces/{NS}/inferenceservices/llama")
    assert kube.names("podmonitors", NS) == {"other-metrics"}


def test_the_pod_monitor_follows_the_spec_and_edits_are_taken_back(
    kube: Kube, tmp_path: Path
) -> None:
    """Turning the service aggregated moves the PodMonitor to the new engine pool; a hand edit
    of it, or its deletion, is undone by the next pass; an unchanged one is not written."""
    declare_pod_monitors(kube)
    kube.apply_isvc(NS, "llama", SPEC)
    reconcile_once(kube, tmp_path)
    isvc = f"/apis/baton.dev/v1alpha1/namespaces/{NS}/inferenceservices/llama"
    kube.patch(isvc, {"spec": {"mode": "aggregated"}})

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")
        monitor = kube.get(MONITOR)
        assert monitor is not None
        assert set(scraped(kube, monitor)) == {"llama-engine", "llama-router"}
        revision = kube.server.handler.revision
        await reconciler.reconcile(NS, "llama")
        assert kube.server.handler.revision == revision
        endpoint = {"port": "http", "path": "/metrics", "interval": "1h"}
        kube.patch(MONITOR, {"spec": {"podMetricsEndpoints": [endpoint]}})
        await reconciler.reconcile(NS, "llama")
        monitor = kube.get(MONITOR)
        assert monitor is not None
        assert monitor["spec"]["podMetricsEndpoints"][0]["interval"] == "30s"
        kube.delete(MONITOR)
        await reconciler.reconcile(NS, "llama")
        assert kube.get(MONITOR) is not None

    run(kube, tmp_path, body)


def test_without_the_kind_nothing_is_made_and_the_service_is_served(
    kube: Kube, tmp_path: Path
) -> None:
    """Where the cluster does not serve PodMonitors the pass makes every other child and writes
    the status as usual, and sends no request for PodMonitors at all."""
    kube.apply_isvc(NS, "llama", SPEC)
    reconcile_once(kube, tmp_path)
    assert {"llama-prefill", "llama-decode", "llama-router"} <= kube.names("deployments", NS)
    assert ready_condition((kube.isvc(NS, "llama") or {}).get("status") or {}) is not None
    assert not [r for r in kube.server.handler if "/podmonitors" in str(r.url)]


def test_a_kind_installed_later_is_found_at_the_next_check(kube: Kube, tmp_path: Path) -> None:
    """Discovery's answer is kept for `recheck_seconds`: a PodMonitor CRD installed while the
    operator runs gets each service its PodMonitor at the first pass after that."""
    kube.apply_isvc(NS, "llama", SPEC)

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")
        declare_pod_monitors(kube)
        await reconciler.reconcile(NS, "llama")
        assert kube.get(MONITOR) is not None

    run(kube, tmp_path, body, recheck_seconds=0)


def test_the_operator_process_makes_pod_monitors_from_its_flags(
    kube: Kube, start_operator: Callable[..., Any]
) -> None:
    """`baton operator` with its PodMonitor flags makes each service's PodMonitor with that
    interval and those labels."""
    declare_pod_monitors(kube)
    flags = ("--pod-monitor-interval", "1m", "--pod-monitor-label", "release=prom")
    start_operator("--namespace", NS, *flags)
    kube.apply_isvc(NS, "llama", SPEC)
    monitor = wait_for(lambda: kube.get(MONITOR), what="the PodMonitor")
    assert monitor["spec"]["podMetricsEndpoints"][0]["interval"] == "1m"
    assert monitor["metadata"]["labels"]["release"] == "prom"


def test_no_pod_monitors_turns_them_off(kube: Kube, start_operator: Callable[..., Any]) -> None:
    """`baton operator --no-pod-monitors` makes none, and does not even ask for the kind."""
    declare_pod_monitors(kube)
    asked_before = len(list(kube.server.handler))  # the test's own discovery request
    start_operator("--namespace", NS, "--no-pod-monitors")
    kube.apply_isvc(NS, "llama", SPEC)
    wait_for(lambda: (kube.isvc(NS, "llama") or {}).get("status"), what="the status")
    requests = list(kube.server.handler)[asked_before:]
    assert not [r for r in requests if "monitoring.coreos.com" in str(r.url)]


@pytest.mark.parametrize("interval", ["15", "fast", "1m 30s", ""])
def test_an_interval_that_is_no_prometheus_duration_is_refused(interval: str) -> None:
    """The scrape interval must be a Prometheus duration, or the operator does not start."""
    with pytest.raises(ValueError, match="not a Prometheus duration"):
        PodMonitorConfig(interval)
    assert monitoring.PodMonitorConfig("1m30s").interval == "1m30s"
