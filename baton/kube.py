"""What the router and the operator agree on about Kubernetes: the `baton.dev/*` label and
annotation names that the operator writes and the router's discovery reads, and `connect`, the
one way either of them reaches the API server (kubernetes_asyncio, from a kubeconfig with any
kind of user, exec credential plugins included, or from the pod's service account).

Both use a few fixed kinds, so requests go to their paths (`resource_path`) as plain JSON
through the library's `ApiClient` (credentials, TLS, token refresh), without its models or API
discovery.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.helpers import get_env_proxy_for_url
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader
from kubernetes_asyncio.config.kube_config import KubeConfigLoader, load_kube_config
from kubernetes_asyncio.dynamic.exceptions import api_exception
from yarl import URL

# On every child and pod of an InferenceService: the service it belongs to.
ISVC_LABEL = "baton.dev/inference-service"
# On engine pods and their headless Services (so also on the EndpointSlices): prefill, decode or
# both. The router's discovery takes an endpoint's role from it.
ROLE_LABEL = "baton.dev/role"
# On engine Services and pods: the model name clients ask for.
SERVED_MODEL_ANNOTATION = "baton.dev/served-model-name"
# On every child the operator makes (the recommended label, with the operator's name), beside a
# controller owner reference to its InferenceService: the two marks the gateway's discovery
# requires of a Service before it routes to its endpoints.
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
OPERATOR_NAME = "baton-operator"
OWNER_GROUP = "baton.dev"
OWNER_KIND = "InferenceService"
# "true" on the engine Services (so on their EndpointSlices) of the one InferenceService that
# holds its served model name; the gateway selects on it, so a later service asking for a name
# already served is never merged into that model's pool.
GATEWAY_LABEL = "baton.dev/gateway"

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_KUBECONFIG = "~/.kube/config"

Manifest = dict[str, Any]
REQUEST_TIMEOUT = 30.0  # seconds for one call: a hung server fails the call, not stalls it
# Seconds to the first byte of a watch request (its events then may take the watch's length).
WATCH_CONNECT_TIMEOUT = 30.0


def resource_path(
    api_version: str, plural: str, namespace: str | None = None, name: str = ""
) -> str:
    """The URL path of a collection (in `namespace`, or in every one) or of one object in it."""
    group, _, version = api_version.rpartition("/")
    where = f"/apis/{group}/{version}" if group else f"/api/{version}"
    if namespace is not None:
        where += f"/namespaces/{namespace}"
    return f"{where}/{plural}/{name}" if name else f"{where}/{plural}"


@dataclass(frozen=True)
class Cluster:
    """One connection to an API server: the library's client over one connection pool, and the
    default namespace of the kubeconfig context or of the pod."""

    api: ApiClient
    namespace: str

    async def call(
        self,
        method: str,
        path: str,
        query: Mapping[str, str] | None = None,
        body: Manifest | None = None,
        content_type: str = "application/json",
        timeout: float | aiohttp.ClientTimeout = REQUEST_TIMEOUT,
    ) -> aiohttp.ClientResponse:
        """One request, with the user's credentials; its response unread (see `checked`).
        `timeout`: seconds for the whole call, or aiohttp's finer limits."""
        response: aiohttp.ClientResponse = await self.api.call_api(
            path,
            method,
            query_params=list((query or {}).items()),
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=timeout,
        )
        return response

    async def request(self, method: str, path: str, **kwargs: Any) -> Manifest:
        """The JSON answer of one `call`; raises the library's error for an error status."""
        return await checked(await self.call(method, path, **kwargs))

    async def watch(
        self, path: str, query: Mapping[str, str], seconds: int
    ) -> AsyncIterator[Manifest]:
        """The events (`{"type": "ADDED", "object": {...}}`, ...) of a watch of `path`, which
        the server ends after `seconds`. An ERROR event (410 Gone when the `resourceVersion` is
        too old) raises the library's error for its code, as an error answer does."""
        query = {**query, "watch": "true", "timeoutSeconds": str(seconds)}
        # A connection that went silent is noticed and replaced.
        timeout = aiohttp.ClientTimeout(
            connect=WATCH_CONNECT_TIMEOUT, sock_read=seconds + WATCH_CONNECT_TIMEOUT
        )
        response = await self.call("GET", path, query=query, timeout=timeout)
        if not 200 <= response.status < 300:
            await checked(response)
        try:
            async for line in response.content:  # one event a line
                if not line.strip():
                    continue
                event: Manifest = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    reason = f"{status.get('reason')}: {status.get('message')}"
                    raise api_exception(ApiException(status=status.get("code"), reason=reason))
                yield event
        finally:
            response.release()

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
    """A connected `Cluster` (see `load_configuration` for where the credentials come from); close
    it when done. Raises the library's `UnauthorizedError` when the server refuses the
    credentials."""
    configuration, namespace = await load_configuration(kubeconfig)
    cluster = Cluster(ApiClient(configuration), namespace)
    try:
        _read_proxy_once(cluster.api)
        await cluster.request("GET", "/version")  # fails clearly on bad credentials
    except BaseException:
        await cluster.close()
        raise
    return cluster


def _read_proxy_once(api: ApiClient) -> None:
    """The library's session looks up the proxy variables and `~/.netrc` again on every request,
    each in a worker thread: more than half of a call's CPU time. The proxy is looked up once
    here instead; a netrc login is never wanted (it would clash with the token sent)."""
    rest = api.rest_client
    if rest.proxy is None:
        with contextlib.suppress(LookupError):
            proxy, auth = get_env_proxy_for_url(URL(api.configuration.host))
            rest.proxy = str(proxy)
            if auth is not None:
                rest.proxy_headers = {"Proxy-Authorization": auth.encode()}
    session: aiohttp.ClientSession = rest.pool_manager
    # The library's read buffer: watch events of large objects exceed aiohttp's default.
    rest.pool_manager = aiohttp.ClientSession(
        connector=session.connector, trust_env=False, read_bufsize=2**21
    )
    session.detach()


async def checked(response: aiohttp.ClientResponse) -> Manifest:
    """The JSON body of one call's response, or the library's error for its status
    (`NotFoundError` for 404, `ConflictError` for 409, ...)."""
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
