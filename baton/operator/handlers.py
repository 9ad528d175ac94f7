"""The kopf side of the operator: which watch events trigger a reconcile. Every event of an
`InferenceService`, and every event of a child (a Deployment's pods becoming ready, a Service
deleted by hand), triggers the same level-triggered `Reconciler.trigger` for the owning
service; a periodic resync catches anything a watch missed. Handlers keep no state in the
objects (no finalizers, no annotations): children go away through owner references.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from baton.kube import ISVC_LABEL, MANAGED_BY_LABEL, Cluster, connect, load_configuration
from baton.operator import crd
from baton.operator.api import PLURALS, Api
from baton.operator.canary import CanaryConfig
from baton.operator.monitoring import PodMonitorConfig
from baton.operator.planner_loop import PlannerLoops
from baton.operator.reconciler import CHILD_KINDS, Reconciler
from baton.operator.resources import DEFAULT_PROMETHEUS_ADDRESS, MANAGER, NetworkAccess

logger = logging.getLogger(__name__)


@dataclass
class Controller:
    """What the handlers share: the API client and the reconciler, made at operator start-up."""

    kubeconfig: str | None  # None: in-cluster, else $KUBECONFIG (see `baton.kube`)
    namespaces: tuple[str, ...]  # empty: every namespace
    default_image: str = ""
    resync_seconds: float = 300.0
    access: NetworkAccess = field(default_factory=NetworkAccess)
    canary: CanaryConfig | None = field(default_factory=CanaryConfig)  # None: no KV canary
    gateway_url: str | None = None
    # None: no PodMonitors (they are made only where the cluster serves the kind anyway).
    monitoring: PodMonitorConfig | None = field(default_factory=PodMonitorConfig)
    # Where KEDA ScaledObjects query Prometheus unless their pool names one, and the planner.
    prometheus_address: str = DEFAULT_PROMETHEUS_ADDRESS
    default_gpu_image: str = ""  # for pools that ask for GPUs; "" means default_image
    reconciler: Reconciler | None = None
    planners: PlannerLoops | None = None  # the SLO planner's loops (`spec.planner`)
    _cluster: Cluster | None = None
    _resync: asyncio.Task[None] | None = field(default=None, repr=False)

    async def start(self) -> None:
        self._cluster = await connect(self.kubeconfig)
        self.reconciler = Reconciler(
            Api(self._cluster),
            self.default_image,
            default_gpu_image=self.default_gpu_image,
            access=self.access,
            namespaces=self.namespaces,
            canary=self.canary,
            gateway_url=self.gateway_url,
            monitoring=self.monitoring,
            prometheus_address=self.prometheus_address,
        )
        self.planners = PlannerLoops(
            self.reconciler.api, self.prometheus_address, self.default_image
        )
        self._resync = asyncio.get_running_loop().create_task(self._resync_loop(self.reconciler))

    async def stop(self) -> None:
        if self._resync is not None:
            self._resync.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._resync
        if self.planners is not None:
            await self.planners.close()
        if self.reconciler is not None:
            await self.reconciler.close()
        if self._cluster is not None:
            await self._cluster.close()

    async def _resync_loop(self, reconciler: Reconciler) -> None:
        """Reconciles every service every `resync_seconds`, whatever the watches said."""
        while True:
            await asyncio.sleep(self.resync_seconds)
            for namespace in self.namespaces or (None,):
                try:
                    found = await reconciler.api.list(crd.API_VERSION, crd.KIND, namespace)
                except Exception as e:  # the next resync tries again
                    logger.warning("resync could not list InferenceServices: %s", e)
                    continue
                for item in found:
                    meta = item["metadata"]
                    if self.planners is not None:
                        self.planners.sync(item)
                    await reconciler.trigger(meta["namespace"], meta["name"])


def register(registry: kopf.OperatorRegistry, controller: Controller) -> None:
    """Adds the operator's handlers to `registry`."""

    @kopf.on.startup(registry=registry)
    async def start(settings: kopf.OperatorSettings, **_: Any) -> None:
        # kopf would turn every per-object log line into a Kubernetes Event; the reconciler
        # posts the Events that matter itself.
        settings.posting.level = logging.WARNING
        # The operator serves one known resource; no need to watch CRDs or namespaces.
        settings.scanning.disabled = True
        settings.watching.server_timeout = 300
        await controller.start()

    @kopf.on.cleanup(registry=registry)
    async def stop(**_: Any) -> None:
        await controller.stop()

    @kopf.on.login(registry=registry)
    async def login(**_: Any) -> kopf.ConnectionInfo:
        # kopf asks again whenever the API answers 401; loading afresh then runs the exec
        # plugin again (or re-reads the service account token).
        return await connection_info(controller.kubeconfig)

    @kopf.on.event(crd.GROUP, crd.VERSION, crd.PLURAL, registry=registry)
    async def service_changed(
        event: kopf.RawEvent, namespace: str | None, name: str, **_: Any
    ) -> None:
        reconciler = controller.reconciler
        if namespace is None or reconciler is None:
            return
        if controller.planners is not None:
            if event.get("type") == "DELETED":
                controller.planners.forget(namespace, name)
            else:
                controller.planners.sync(cast(dict[str, Any], event["object"]))
        if event.get("type") == "DELETED":
            reconciler.forget(namespace, name)
        elif not reconciler.own_write(crd.KIND, namespace, name, _version(event)):
            await reconciler.trigger(namespace, name)

    async def child_changed(
        event: kopf.RawEvent, namespace: str | None, name: str, labels: kopf.Labels, **_: Any
    ) -> None:
        owner = labels.get(ISVC_LABEL)
        reconciler = controller.reconciler
        if not owner or not namespace or reconciler is None:
            return
        kind = event.get("object", {}).get("kind", "")
        deleted = event.get("type") == "DELETED"
        if deleted or not reconciler.own_write(kind, namespace, name, _version(event)):
            await reconciler.trigger(namespace, owner)

    for kind, api_version in CHILD_KINDS.items():
        group, _, version = api_version.rpartition("/")
        kopf.on.event(
            group, version, PLURALS[kind], labels={MANAGED_BY_LABEL: MANAGER}, registry=registry
        )(child_changed)


async def connection_info(kubeconfig: str | None) -> kopf.ConnectionInfo:
    """kopf's credentials, as the client library loads them (`baton.kube.load_configuration`):
    the server, TLS files, and the bearer token of the kubeconfig user, its exec plugin, or the
    pod's service account."""
    configuration, namespace = await load_configuration(kubeconfig)
    header = await configuration.get_api_key_with_prefix("BearerToken")
    scheme, _, token = str(header or "").rpartition(" ")
    if not configuration.host:
        raise kopf.LoginError("the kubeconfig names no API server")
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        scheme=scheme or None,
        token=token or None,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
        default_namespace=namespace,
    )


def _version(event: kopf.RawEvent) -> str:
    return str(event.get("object", {}).get("metadata", {}).get("resourceVersion", ""))
