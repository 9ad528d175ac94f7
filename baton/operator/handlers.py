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
from typing import Any

import kopf

from baton.operator import crd
from baton.operator.kube import KubeClient, KubeConfig, resource_path
from baton.operator.reconciler import CHILD_KINDS, Reconciler
from baton.operator.resources import ISVC_LABEL, MANAGED_BY_LABEL, MANAGER

logger = logging.getLogger(__name__)


@dataclass
class Controller:
    """What the handlers share: the API client and the reconciler, made at operator start-up."""

    config: KubeConfig
    namespaces: tuple[str, ...]  # empty: every namespace
    default_image: str = ""
    resync_seconds: float = 300.0
    reconciler: Reconciler | None = None
    _client: KubeClient | None = None
    _resync: asyncio.Task[None] | None = field(default=None, repr=False)

    async def start(self) -> None:
        self._client = await KubeClient(self.config).__aenter__()
        self.reconciler = Reconciler(self._client, self.default_image)
        self._resync = asyncio.get_running_loop().create_task(self._resync_loop())

    async def stop(self) -> None:
        if self._resync is not None:
            self._resync.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._resync
        if self.reconciler is not None:
            await self.reconciler.close()
        if self._client is not None:
            await self._client.__aexit__(None, None, None)

    async def trigger(self, namespace: str, name: str) -> None:
        if self.reconciler is not None:
            await self.reconciler.trigger(namespace, name)

    async def _resync_loop(self) -> None:
        """Reconciles every service every `resync_seconds`, whatever the watches said."""
        assert self._client is not None
        while True:
            await asyncio.sleep(self.resync_seconds)
            for namespace in self.namespaces or (None,):
                try:
                    found = await self._client.list(
                        resource_path(crd.API_VERSION, crd.PLURAL, namespace)
                    )
                except Exception as e:  # the next resync tries again
                    logger.warning("resync could not list InferenceServices: %s", e)
                    continue
                for item in found.get("items", []):
                    meta = item["metadata"]
                    await self.trigger(meta["namespace"], meta["name"])


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
    def login(**_: Any) -> kopf.ConnectionInfo:
        config = controller.config
        return kopf.ConnectionInfo(
            server=config.server,
            ca_path=config.ca_file,
            insecure=config.insecure,
            token=config.bearer_token(),
            certificate_path=config.cert_file,
            private_key_path=config.key_file,
            default_namespace=config.namespace,
        )

    @kopf.on.event(crd.GROUP, crd.VERSION, crd.PLURAL, registry=registry)
    async def service_changed(
        event: kopf.RawEvent, namespace: str | None, name: str, **_: Any
    ) -> None:
        if namespace is None:
            return
        reconciler = controller.reconciler
        if reconciler is None:
            return
        if event.get("type") == "DELETED":
            reconciler.forget(namespace, name)
        elif not reconciler.own_write(crd.KIND, namespace, name, _version(event)):
            await controller.trigger(namespace, name)

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
            await controller.trigger(namespace, owner)

    for api_version, plural in CHILD_KINDS.values():
        group, _, version = api_version.rpartition("/")
        kopf.on.event(
            group, version, plural, labels={MANAGED_BY_LABEL: MANAGER}, registry=registry
        )(child_changed)


def _version(event: kopf.RawEvent) -> str:
    return str(event.get("object", {}).get("metadata", {}).get("resourceVersion", ""))
