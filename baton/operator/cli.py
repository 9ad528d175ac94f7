"""`baton operator`: runs the `InferenceService` operator (kopf) against the cluster it runs in,
or the one `KUBECONFIG` names, for one or more namespaces or all of them."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import kopf

from baton.kube import SERVICE_ACCOUNT, load_configuration
from baton.operator.canary import CanaryConfig
from baton.operator.handlers import Controller, register
from baton.operator.monitoring import PodMonitorConfig
from baton.operator.resources import DEFAULT_PROMETHEUS_ADDRESS, NetworkAccess

DEFAULT_NAMESPACE = "baton-system"


def add_args(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="watch this namespace (repeatable; default: the current context's or pod's)",
    )
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument(
        "--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, $KUBECONFIG)"
    )
    parser.add_argument(
        "--default-image",
        default=os.environ.get("BATON_DEFAULT_IMAGE", ""),
        help="image for services whose spec names none ($BATON_DEFAULT_IMAGE)",
    )
    parser.add_argument(
        "--default-gpu-image",
        default=os.environ.get("BATON_DEFAULT_GPU_IMAGE", ""),
        help="image for the engines of pools that ask for nvidia.com/gpu in services whose spec "
        "names none: the Dockerfile's cuda target ($BATON_DEFAULT_GPU_IMAGE; default: "
        "--default-image)",
    )
    parser.add_argument(
        "--gateway-namespace",
        default="baton-system",
        help="namespace of the gateway's pods (app.kubernetes.io/name=baton-gateway), which the "
        "engines' NetworkPolicy lets in",
    )
    parser.add_argument(
        "--monitoring-namespace",
        default="monitoring",
        help="namespace whose pods may scrape the engines' HTTP port ('': none)",
    )
    parser.add_argument(
        "--operator-namespace",
        default=None,
        help="namespace of the operator's own pods (app.kubernetes.io/component=operator), which "
        "the engines' NetworkPolicy lets in for the KV canary (default: the namespace this pod "
        "runs in, else baton-system)",
    )
    parser.add_argument(
        "--gateway-url",
        default="",
        help="the cluster gateway's URL, said in the status of every service it serves "
        "('': no gateway)",
    )
    parser.add_argument(
        "--kv-canary-seconds",
        type=float,
        default=60.0,
        help="run a canary KV hand-off between each disaggregated service's pools this often "
        "(KVPathReady; 0: never, and no KVPathReady)",
    )
    parser.add_argument(
        "--kv-canary-timeout",
        type=float,
        default=10.0,
        help="seconds one canary hand-off may take before it counts as failed",
    )
    parser.add_argument(
        "--pod-monitors",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="make a Prometheus Operator PodMonitor for each service's engine and router pods, "
        "where the cluster serves the PodMonitor CRD",
    )
    parser.add_argument(
        "--pod-monitor-interval",
        default="15s",
        help="how often the PodMonitors have Prometheus scrape the pods",
    )
    parser.add_argument(
        "--pod-monitor-label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label on every PodMonitor, for a Prometheus' podMonitorSelector (repeatable)",
    )
    parser.add_argument(
        "--prometheus-address",
        default=DEFAULT_PROMETHEUS_ADDRESS,
        help="the Prometheus that KEDA ScaledObjects query (autoscaling.engine: keda), unless a "
        "pool's autoscaling.prometheusAddress names another, and that the SLO planner "
        "(spec.planner) reads",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=8080,
        help="port of the liveness endpoint /healthz (0: none)",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=300.0,
        help="reconcile every service this often even without events",
    )


def own_namespace() -> str:
    """The namespace of the pod this runs in (its service account's), else baton-system."""
    try:
        return (SERVICE_ACCOUNT / "namespace").read_text().strip() or DEFAULT_NAMESPACE
    except OSError:
        return DEFAULT_NAMESPACE


def _labels(pairs: list[str]) -> dict[str, str]:
    """`KEY=VALUE` flags as a dict; raises `ValueError` for one without `=`."""
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--pod-monitor-label {pair!r}: expected KEY=VALUE")
        labels[key] = value
    return labels


def run(args: argparse.Namespace) -> int:
    asyncio.run(_operate(args))
    return 0


async def _operate(args: argparse.Namespace) -> None:
    namespaces: tuple[str, ...] = tuple(args.namespace)
    if not args.all_namespaces and not namespaces:
        _, default = await load_configuration(args.kubeconfig)
        namespaces = (default,)
    access = NetworkAccess(
        args.gateway_namespace,
        monitoring_namespace=args.monitoring_namespace or None,
        operator_namespace=args.operator_namespace or own_namespace(),
    )
    canary = None
    if args.kv_canary_seconds > 0:
        canary = CanaryConfig(args.kv_canary_seconds, args.kv_canary_timeout)
    monitoring = None
    if args.pod_monitors:
        monitoring = PodMonitorConfig(args.pod_monitor_interval, _labels(args.pod_monitor_label))
    controller = Controller(
        args.kubeconfig,
        namespaces,
        args.default_image,
        args.resync_seconds,
        access,
        canary,
        args.gateway_url or None,
        monitoring,
        args.prometheus_address,
        default_gpu_image=args.default_gpu_image,
    )
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        # kopf logs every handled watch event at INFO; the reconciler logs what it changes.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    registry = kopf.OperatorRegistry()
    register(registry, controller)
    liveness = f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
    await kopf.operator(
        registry=registry,
        standalone=True,  # one replica (Recreate strategy): no peering objects needed
        clusterwide=args.all_namespaces,
        namespaces=namespaces,
        liveness_endpoint=liveness,
    )
