"""What the router and the operator agree on about Kubernetes: the `baton.dev/*` label and
annotation names that the operator writes and the router's discovery reads, and `connect`, the
one way either of them reaches the API server (kubernetes_asyncio, from a kubeconfig with any
kind of user, exec credential plugins included, or from the pod's service account).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader
from kubernetes_asyncio.config.kube_config import KubeConfigLoader, load_kube_config
from kubernetes_asyncio.dynamic import DynamicClient, LazyDiscoverer, Resource
from kubernetes_asyncio.dynamic.exceptions import api_exception

logger = logging.getLogger(__name__)

# On every child and pod of an InferenceService: the service it belongs to.
ISVC_LABEL = "baton.dev/inference-service"
# On engine pods and their headless Services (so also on the EndpointSlices): prefill, decode or
# both. The router's discovery takes an endpoint's role from it.
ROLE_LABEL = "baton.dev/role"
# On engine Services and pods: the model name clients ask for.
SERVED_MODEL_ANNOTATION = "baton.dev/served-model-name"

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_KUBECONFIG = "~/.kube/config"

Manifest = dict[str, Any]
# A path that cannot exist, so that no discovery cache file is ever read (see MemoryDiscoverer).
NO_CACHE_FILE = os.path.join(os.devnull, "baton-discovery")


class MemoryDiscoverer(LazyDiscoverer):
    """The library's lazy API discovery, kept in memory only. By default it shares one cache
    file per server URL in the temporary folder (never removed, read by any later process);
    the operator's and the routers' root filesystems are read-only, and discovery is a few
    small calls per connection."""

    def _write_cache(self) -> None:
        pass


@dataclass(frozen=True)
class Cluster:
    """One connection to an API server: the library's generic client (any kind, custom resources
    included, as plain JSON) over one connection pool, and the default namespace of the
    kubeconfig context or of the pod."""

    api: ApiClient
    client: DynamicClient
    namespace: str

    @property
    def configuration(self) -> Configuration:
        """Server, TLS files and credentials (what kopf logs in with)."""
        configuration: Configuration = self.api.configuration
        return configuration

    async def close(self) -> None:
        await self.api.close()


async def load_configuration(kubeconfig: str | None = None) -> tuple[Configuration, str]:
    """The client configuration and the default namespace, from `kubeconfig`, else the pod's
    service account when running in a cluster without `$KUBECONFIG`, else `$KUBECONFIG` (every
    file it lists, merged as kubectl does) or `~/.kube/config`. Runs the user's exec credential
    plugin, if any, and keeps its token fresh: it runs again when the token it gave expires."""
    configuration = Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path is None and "KUBERNETES_SERVICE_HOST" in os.environ:
        # Re-reads the token file every minute: bound service account tokens rotate.
        InClusterConfigLoader(
            token_filename=str(SERVICE_ACCOUNT / "token"),
            cert_filename=str(SERVICE_ACCOUNT / "ca.crt"),
        ).load_and_set(configuration)
        namespace = (SERVICE_ACCOUNT / "namespace").read_text().strip()
        return configuration, namespace or "default"
    path = path or DEFAULT_KUBECONFIG
    files = [Path(p).expanduser() for p in path.split(os.pathsep) if p]
    if not any(f.is_file() for f in files):
        raise FileNotFoundError(f"no kubeconfig at {path} and not running in a cluster")
    loader = await load_kube_config(
        config_file=path, client_configuration=configuration, persist_config=False
    )
    _refresh_exec_token(loader, configuration)
    context = (loader.current_context or {}).get("context") or {}
    return configuration, str(context.get("namespace") or "default")


def _refresh_exec_token(loader: KubeConfigLoader, configuration: Configuration) -> None:
    """Makes every request check the exec plugin's token first. The library runs the plugin once
    at load time; its loader re-runs it only once the token's `expirationTimestamp` has passed,
    so this costs nothing per request, and a token without an expiry is kept."""

    async def refresh(config: Configuration, *_: Any) -> None:
        if getattr(loader, "exec_plugin_expiry", None) is None:
            return
        await loader.load_from_exec_plugin()
        config.api_key["BearerToken"] = loader.token

    user = loader._user  # the library exposes no other way to ask
    if user is not None and "exec" in user:
        configuration.refresh_api_key_hook = refresh


async def connect(kubeconfig: str | None = None) -> Cluster:
    """A connected `Cluster` (see `load_configuration` for where the credentials come from). The
    generic client reads the server's API discovery once; close the cluster when done. Raises
    the library's `UnauthorizedError` when the server refuses the credentials."""
    configuration, namespace = await load_configuration(kubeconfig)
    api = ApiClient(configuration)
    try:
        client = DynamicClient(api, cache_file=NO_CACHE_FILE, discoverer=MemoryDiscoverer)
        # Discovery would take an error answer for an empty API; a plain call first fails
        # clearly on bad credentials or a wrong server.
        await checked(client.request("get", "/version", serialize=False))
        await client  # reads discovery
    except BaseException:
        await api.close()
        raise
    return Cluster(api, client, namespace)


async def resource(client: DynamicClient, api_version: str, kind: str) -> Resource:
    """The generic client's handle on one kind, e.g. `("apps/v1", "Deployment")`. Naming the
    API group exactly keeps the lookup to that group's discovery document."""
    group, _, version = api_version.rpartition("/")
    found: Resource = await client.resources.get(
        prefix="apis" if group else "api", group=group, api_version=version, kind=kind
    )
    return found


async def checked(call: Awaitable[Any]) -> Manifest:
    """The JSON body of one generic-client call made with `serialize=False`, or the library's
    error for its status (`NotFoundError` for 404, `ConflictError` for 409, ...): the generic
    client itself would hand back an error's `Status` body as if it were the object."""
    response: aiohttp.ClientResponse = await call
    try:
        body = await response.read()
    finally:
        response.release()
    if 200 <= response.status < 300:
        result: Manifest = json.loads(body) if body else {}
        return result
    try:
        message = str(json.loads(body).get("message", ""))
    except (ValueError, AttributeError):
        message = body[:500].decode(errors="replace")
    reason = f"{response.reason}: {message}"
    raise api_exception(ApiException(status=response.status, reason=reason))
