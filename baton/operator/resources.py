"""Pure builders of every child of an `InferenceService`: engine and router Deployments, the
router Service and a headless Service per role, HPAs or KEDA ScaledObjects, PodDisruptionBudgets,
the router's ServiceAccount, Role and RoleBinding, the NetworkPolicy that fences the engines, and
the hand-off Secret of a disaggregated service. `desired_children` is the whole desired state; the
reconciler applies it. Every child carries a controller owner reference, so deleting the
`InferenceService` garbage-collects it.
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass, field
from typing import Any

from baton.kube import (
    GATEWAY_LABEL,
    ISVC_LABEL,
    MANAGED_BY_LABEL,
    OPERATOR_NAME,
    ROLE_LABEL,
    SERVED_MODEL_ANNOTATION,
)
from baton.operator import crd
from baton.operator.pods import (
    ENGINE_PORT,
    KV_EVENTS_PORT,
    KV_PORT,
    KV_SECRET_KEY,
    ROUTER_PORT,
    engine_pod,
    router_pod,
)
from baton.operator.revision import REVISION_LABEL, revision
from baton.operator.spec import Autoscaling, InferenceServiceSpec, Pool
from baton.operator.validation import SpecError

Manifest = dict[str, Any]

NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
APP = "baton"
MANAGER = OPERATOR_NAME
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by Kubernetes on every namespace
# Children get names "<isvc>-prefill" etc., which must stay valid Service names (63 characters).
MAX_NAME_LENGTH = 63 - len("-prefill")
KEDA_API_VERSION = "keda.sh/v1alpha1"
# KEDA names the HPA it makes for a ScaledObject so; KEDA's webhook refuses the ScaledObject
# when that name is over 63 characters.
KEDA_HPA_PREFIX = "keda-hpa-"
# KEDA copies a ScaledObject's labels to its HPA except those named here: without the operator's
# managed-by label, that HPA is neither watched nor taken for one of the operator's children.
KEDA_EXCLUDED_LABELS = "scaledobject.keda.sh/hpa-excluded-labels"
# Where ScaledObjects query when neither the pool nor the operator says: the Service the
# Prometheus Operator makes for its Prometheus, in kube-prometheus-stack's usual namespace.
DEFAULT_PROMETHEUS_ADDRESS = "http://prometheus-operated.monitoring.svc:9090"
# The router's gauge of requests waiting for an engine of their model (none is up).
HELD_REQUESTS_METRIC = "baton:router_held_requests"
RUNNING_REQUESTS_METRIC = "vllm:num_requests_running"
# The chart's prometheus-adapter exposes each engine histogram `<name>` to HPAs as `<name>_mean`,
# its mean per pod over a window (1m by default); a keda pool's query computes the same.
HISTOGRAM_MEAN_SUFFIX = "_mean"
HISTOGRAM_MEAN_WINDOW = "1m"


@dataclass(frozen=True)
class NetworkAccess:
    """Who besides the service's own router may reach its engines' HTTP port: the gateway's pods,
    a monitoring namespace, and the operator's own pods, whose KV canary talks to the engines
    (operator flags: the cluster's admin decides, not a spec)."""

    gateway_namespace: str = "baton-system"
    gateway_labels: dict[str, str] = field(
        default_factory=lambda: {NAME_LABEL: "baton-gateway", COMPONENT_LABEL: "gateway"}
    )
    monitoring_namespace: str | None = "monitoring"  # None: no scraping from outside
    operator_namespace: str = "baton-system"
    operator_labels: dict[str, str] = field(default_factory=lambda: {COMPONENT_LABEL: "operator"})

    def __post_init__(self) -> None:
        if not self.gateway_namespace or not self.gateway_labels:
            raise ValueError("the gateway's namespace and pod labels must not be empty")
        if not self.operator_namespace or not self.operator_labels:
            raise ValueError("the operator's namespace and pod labels must not be empty")


def check_name(name: str) -> None:
    """Rejects an `InferenceService` name whose children's names would be too long."""
    if len(name) > MAX_NAME_LENGTH:
        raise SpecError(
            "NameTooLong",
            f"metadata.name {name!r} has {len(name)} characters; at most {MAX_NAME_LENGTH} leave "
            "room for the children's suffixes",
        )


def selector_labels(name: str, component: str) -> dict[str, str]:
    """The immutable Deployment selector: never add to it, or existing Deployments break."""
    return {NAME_LABEL: APP, INSTANCE_LABEL: name, COMPONENT_LABEL: component}


def labels(name: str, component: str, role: str | None = None) -> dict[str, str]:
    """The labels of every child and pod of the service `name` (engines also carry the role)."""
    result = {**selector_labels(name, component), MANAGED_BY_LABEL: MANAGER, ISVC_LABEL: name}
    if role is not None:
        result[ROLE_LABEL] = role
    return result


def _scraped_at(port: int) -> dict[str, str]:
    """The pod annotations that point Prometheus at the pod's /metrics on `port`."""
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }


def owner_reference(isvc: Manifest) -> Manifest:
    meta = isvc["metadata"]
    return {
        "apiVersion": crd.API_VERSION,
        "kind": crd.KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _child(
    api_version: str,
    kind: str,
    name: str,
    isvc: Manifest,
    child_labels: dict[str, str],
    annotations: dict[str, str] | None = None,
) -> Manifest:
    meta: Manifest = {
        "name": name,
        "namespace": isvc["metadata"]["namespace"],
        "labels": child_labels,
        "ownerReferences": [owner_reference(isvc)],
    }
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": api_version, "kind": kind, "metadata": meta}


def _engine_children(
    isvc: Manifest, spec: InferenceServiceSpec, pool: Pool, routable: bool, prometheus: str
) -> list[Manifest]:
    name = isvc["metadata"]["name"]
    child_name = f"{name}-{pool.component}"
    pool_labels = labels(name, pool.component, pool.role)
    served = {SERVED_MODEL_ANNOTATION: spec.model.served_model_name}
    pod_annotations = {**_scraped_at(ENGINE_PORT), **served}
    selector = selector_labels(name, pool.component)
    # On the pods and their Deployment only: Services, PDBs and selectors span revisions.
    revision_labels = {**pool_labels, REVISION_LABEL: revision(spec)}
    deployment = _child("apps/v1", "Deployment", child_name, isvc, revision_labels)
    deployment["spec"] = {
        "selector": {"matchLabels": selector},
        "template": engine_pod(
            spec, pool, dict(revision_labels), pod_annotations, kv_secret_name(name)
        ),
    }
    if spec.sets_replicas(pool):  # otherwise an autoscaler or the planner owns them
        deployment["spec"]["replicas"] = pool.replicas
    # Headless: the router needs every pod's address (EndpointSlices), not one virtual IP.
    service_labels = {**pool_labels, GATEWAY_LABEL: "true"} if routable else pool_labels
    service = _child("v1", "Service", child_name, isvc, service_labels, served)
    ports = [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}]
    if pool.moves_kv:
        ports.append({"name": "kv", "port": KV_PORT, "targetPort": "kv", "protocol": "TCP"})
    service["spec"] = {"clusterIP": "None", "selector": selector, "ports": ports}
    children = [deployment, service, _pdb(isvc, child_name, pool_labels, selector)]
    if pool.autoscaling is not None and pool.autoscaling.engine == "keda":
        auto = pool.autoscaling
        children.append(_scaled_object(isvc, spec, pool, auto, pool_labels, prometheus))
    elif pool.autoscaling is not None:
        auto = pool.autoscaling
        hpa = _child("autoscaling/v2", "HorizontalPodAutoscaler", child_name, isvc, pool_labels)
        hpa["spec"] = {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": child_name},
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": auto.metric},
                        "target": {"type": "AverageValue", "averageValue": auto.target},
                    },
                }
            ],
        }
        children.append(hpa)
    return children


def _scaled_object(
    isvc: Manifest,
    spec: InferenceServiceSpec,
    pool: Pool,
    auto: Autoscaling,
    pool_labels: dict[str, str],
    prometheus: str,
) -> Manifest:
    """The KEDA ScaledObject of an autoscaled pool: its Deployment between the pool's bounds on
    two Prometheus queries, each with the labels the operator's PodMonitor gives the targets.

    `load`: the pool's metric averaged over its pods against the target, as the HPA's Pods
    metric would be (metricType Value: KEDA's HPA then wants replicas × value / target).
    `wake`, for a pool that may go to zero: requests the service's routers hold for want of an
    engine, plus those the pool is running, against maxNumSeqs (AverageValue: one engine per
    maxNumSeqs of them). Above 0 it keeps the pool up, so a request held by the router wakes a
    pool at zero, and one busy without a queue (whose waiting metric reads 0) is not put to sleep.
    """
    meta = isvc["metadata"]
    name = f"{meta['name']}-{pool.component}"
    if len(KEDA_HPA_PREFIX + name) > 63:
        raise SpecError(
            "NameTooLong",
            f"metadata.name {meta['name']!r} is too long for engine: keda: KEDA names its HPA "
            f"{KEDA_HPA_PREFIX}{name}, over 63 characters; use a shorter name, or engine: hpa",
        )
    service = f'namespace="{meta["namespace"]}",inference_service="{meta["name"]}"'
    pool_series = f'{service},pool="{pool.component}"'
    server = auto.prometheus_address or prometheus
    triggers: list[Manifest] = [
        {
            "type": "prometheus",
            "name": "load",
            "metricType": "Value",
            "metadata": {
                "serverAddress": server,
                "query": _pool_average(auto.metric, pool_series),
                "threshold": auto.threshold,
            },
        }
    ]
    if auto.min_replicas == 0:
        held = f"sum({HELD_REQUESTS_METRIC}{{{service}}})"
        running = f"sum({RUNNING_REQUESTS_METRIC}{{{pool_series}}})"
        triggers.append(
            {
                "type": "prometheus",
                "name": "wake",
                "metricType": "AverageValue",
                "metadata": {
                    "serverAddress": server,
                    "query": f"({held} or vector(0)) + ({running} or vector(0))",
                    "threshold": str(spec.engine.max_num_seqs),
                    "activationThreshold": "0",
                },
            }
        )
    scaled = _child(
        KEDA_API_VERSION,
        "ScaledObject",
        name,
        isvc,
        pool_labels,
        {KEDA_EXCLUDED_LABELS: MANAGED_BY_LABEL},
    )
    scaled["spec"] = {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
        "minReplicaCount": auto.min_replicas,
        "maxReplicaCount": auto.max_replicas,
        "triggers": triggers,
    }
    return scaled


def _pool_average(metric: str, series: str) -> str:
    """PromQL for `metric` averaged over the pods whose series match `series`. A name the
    prometheus-adapter makes of a histogram (`<name>_mean`) is no series in Prometheus: it is
    the adapter's per-pod mean, rate of the sum over rate of the count, computed here alike."""
    if not metric.endswith(HISTOGRAM_MEAN_SUFFIX):
        return f"avg({metric}{{{series}}})"
    histogram = metric.removesuffix(HISTOGRAM_MEAN_SUFFIX)
    window = HISTOGRAM_MEAN_WINDOW
    return (
        f"avg(rate({histogram}_sum{{{series}}}[{window}]) / "
        f"clamp_min(rate({histogram}_count{{{series}}}[{window}]), 1e-9))"
    )


def _pdb(
    isvc: Manifest, name: str, pdb_labels: dict[str, str], selector: dict[str, str]
) -> Manifest:
    pdb = _child("policy/v1", "PodDisruptionBudget", name, isvc, pdb_labels)
    pdb["spec"] = {"maxUnavailable": 1, "selector": {"matchLabels": selector}}
    return pdb


def _router_children(isvc: Manifest, spec: InferenceServiceSpec) -> list[Manifest]:
    name = isvc["metadata"]["name"]
    namespace = isvc["metadata"]["namespace"]
    child_name = f"{name}-router"
    router_labels = labels(name, "router")
    selector = selector_labels(name, "router")
    account = _child("v1", "ServiceAccount", child_name, isvc, router_labels)
    role = _child("rbac.authorization.k8s.io/v1", "Role", child_name, isvc, router_labels)
    role["rules"] = [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        },
        {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "watch"]},
    ]
    binding = _child("rbac.authorization.k8s.io/v1", "RoleBinding", child_name, isvc, router_labels)
    binding["roleRef"] = {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": child_name,
    }
    binding["subjects"] = [{"kind": "ServiceAccount", "name": child_name, "namespace": namespace}]
    deployment = _child("apps/v1", "Deployment", child_name, isvc, router_labels)
    deployment["spec"] = {
        "replicas": spec.router.replicas,
        "selector": {"matchLabels": selector},
        "template": router_pod(
            spec,
            namespace,
            f"{ISVC_LABEL}={name}",
            child_name,
            router_labels,
            _scraped_at(ROUTER_PORT),
        ),
    }
    service = _child("v1", "Service", name, isvc, router_labels)
    service["spec"] = {
        "type": spec.router.service_type,
        "selector": selector,
        "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
    }
    pdb = _pdb(isvc, child_name, router_labels, selector)
    return [account, role, binding, deployment, service, pdb]


def _network_policy(isvc: Manifest, spec: InferenceServiceSpec, access: NetworkAccess) -> Manifest:
    """Engine HTTP only from this service's router, the gateway, the operator (its KV canary)
    and monitoring; KV ports (TCP blocks and NIXL's side channel, one port per tensor-parallel
    rank) only from this service's decode engines, the only pods that pull KV blocks; the KV
    events' ports only from the routers."""
    name = isvc["metadata"]["name"]
    policy_labels = labels(name, "network-policy")
    policy = _child("networking.k8s.io/v1", "NetworkPolicy", f"{name}-engines", isvc, policy_labels)

    def namespace(ns: str) -> Manifest:
        return {"matchLabels": {NAMESPACE_NAME_LABEL: ns}}

    http_from: list[Manifest] = [
        {"podSelector": {"matchLabels": selector_labels(name, "router")}},
        {
            "namespaceSelector": namespace(access.gateway_namespace),
            "podSelector": {"matchLabels": dict(access.gateway_labels)},
        },
        {
            "namespaceSelector": namespace(access.operator_namespace),
            "podSelector": {"matchLabels": dict(access.operator_labels)},
        },
    ]
    if access.monitoring_namespace:
        http_from.append({"namespaceSelector": namespace(access.monitoring_namespace)})
    ingress: list[Manifest] = [
        {"from": http_from, "ports": [{"protocol": "TCP", "port": ENGINE_PORT}]}
    ]
    if spec.mode == "disaggregated":
        ranks = max(pool.tensor_parallel_size for pool in spec.pools)
        kv_ports = [{"protocol": "TCP", "port": KV_PORT + r} for r in range(ranks)]
        decode = {"podSelector": {"matchLabels": selector_labels(name, "decode")}}
        ingress.append({"from": [decode], "ports": kv_ports})
    # No rule admits the KV ports in aggregated mode: nothing pulls blocks from those engines.
    if spec.engine.enable_prefix_caching:
        # KV events carry the prompts' token ids: only the routers (this service's, and the
        # gateway's) read them.
        events = [{"protocol": "TCP", "port": KV_EVENTS_PORT + i} for i in range(2)]
        ingress.append({"from": http_from[:2], "ports": events})
    policy["spec"] = {
        "podSelector": {
            "matchLabels": {NAME_LABEL: APP, INSTANCE_LABEL: name},
            "matchExpressions": [{"key": ROLE_LABEL, "operator": "Exists"}],
        },
        "policyTypes": ["Ingress"],
        "ingress": ingress,
    }
    return policy


def kv_secret_name(name: str) -> str:
    """The hand-off Secret of the service `name`."""
    return f"{name}-kv-secret"


def kv_secret(isvc: Manifest) -> Manifest:
    """The hand-off Secret without its data: the reconciler creates it once with
    `fresh_kv_secret_data()` and never writes it again, so that a user's rotation stays."""
    name = isvc["metadata"]["name"]
    secret = _child("v1", "Secret", kv_secret_name(name), isvc, labels(name, "kv-secret"))
    secret["type"] = "Opaque"
    return secret


def fresh_kv_secret_data() -> dict[str, str]:
    """The Secret's `data`: one new random secret as the only line of the key file."""
    line = secrets.token_hex(32) + "\n"
    return {KV_SECRET_KEY: base64.b64encode(line.encode()).decode()}


def desired_children(
    isvc: Manifest,
    spec: InferenceServiceSpec,
    access: NetworkAccess | None = None,
    routable: bool = True,
    prometheus: str = DEFAULT_PROMETHEUS_ADDRESS,
) -> list[Manifest]:
    """Every child the operator keeps for `isvc` (a body with metadata.name/namespace/uid).
    `routable` is False when an earlier service holds the served model name: its engine
    Services then lack the gateway's label. `prometheus` is where ScaledObjects query unless
    their pool names a Prometheus."""
    check_name(isvc["metadata"]["name"])
    children: list[Manifest] = []
    for pool in spec.pools:
        children += _engine_children(isvc, spec, pool, routable, prometheus)
    children.append(_network_policy(isvc, spec, access or NetworkAccess()))
    if any(pool.moves_kv for pool in spec.pools):
        children.append(kv_secret(isvc))
    return children + _router_children(isvc, spec)


def service_url(isvc: Manifest, router_service: Manifest | None) -> str:
    """Where clients reach the service: the load balancer once it has an address, else the
    in-cluster DNS name."""
    meta = isvc["metadata"]
    if router_service is not None:
        for ingress in router_service.get("status", {}).get("loadBalancer", {}).get("ingress", []):
            host = ingress.get("hostname") or ingress.get("ip")
            if host:
                return f"http://{host}"
    return f"http://{meta['name']}.{meta['namespace']}.svc"
