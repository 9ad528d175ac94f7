"""A small asynchronous Kubernetes API client on plain JSON objects, shared by the operator and
the router's EndpointSlice discovery: where the API server is and how to authenticate
(in-cluster service account, or a kubeconfig with a token or client certificate), and
get / list / create / patch / delete / watch on any resource path.

Kubeconfigs that authenticate through `exec` plugins or auth providers are not supported; use a
token or a client certificate (or run in the cluster).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import ssl
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True)
class KubeConfig:
    """Where the API server is and who we are."""

    server: str  # e.g. "https://10.96.0.1:443"
    namespace: str = "default"  # the context's or the pod's namespace
    token: str | None = None
    token_file: str | None = None  # re-read on every request: bound tokens rotate
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool = False

    def bearer_token(self) -> str | None:
        if self.token_file:
            return Path(self.token_file).read_text().strip()
        return self.token


def load_config(kubeconfig: str | None = None) -> KubeConfig:
    """The in-cluster service account when running in a pod (and no kubeconfig is named), else
    `kubeconfig`, `$KUBECONFIG` or `~/.kube/config`."""
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path is None and "KUBERNETES_SERVICE_HOST" in os.environ:
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        host = f"[{host}]" if ":" in host else host
        return KubeConfig(
            server=f"https://{host}:{port}",
            namespace=(SERVICE_ACCOUNT / "namespace").read_text().strip(),
            token_file=str(SERVICE_ACCOUNT / "token"),
            ca_file=str(SERVICE_ACCOUNT / "ca.crt"),
        )
    path = path or str(Path.home() / ".kube" / "config")
    file = Path(path.split(os.pathsep)[0])
    if not file.exists():
        raise FileNotFoundError(f"no kubeconfig at {file} and not running in a cluster")
    return _from_kubeconfig(yaml.safe_load(file.read_text()), file.parent)


def _from_kubeconfig(doc: dict[str, Any], base: Path) -> KubeConfig:
    def named(section: str, name: str) -> dict[str, Any]:
        for entry in doc.get(section) or []:
            if entry.get("name") == name:
                return entry.get(section.rstrip("s")) or {}
        raise ValueError(f"kubeconfig has no {section.rstrip('s')} named {name!r}")

    context = named("contexts", doc.get("current-context", ""))
    cluster = named("clusters", context["cluster"])
    user = named("users", context["user"]) if context.get("user") else {}
    if "exec" in user or "auth-provider" in user:
        raise ValueError("kubeconfig users with exec or auth-provider are not supported")

    def file_of(key: str) -> str | None:
        if user.get(f"{key}-data") or cluster.get(f"{key}-data"):
            data = user.get(f"{key}-data") or cluster[f"{key}-data"]
            with tempfile.NamedTemporaryFile(prefix="baton-", suffix=".pem", delete=False) as f:
                f.write(base64.b64decode(data))
            return f.name
        value = user.get(key) or cluster.get(key)
        return str(base / value) if value else None

    return KubeConfig(
        server=cluster["server"].rstrip("/"),
        namespace=context.get("namespace", "default"),
        token=user.get("token"),
        token_file=str(base / user["tokenFile"]) if user.get("tokenFile") else None,
        ca_file=file_of("certificate-authority"),
        cert_file=file_of("client-certificate"),
        key_file=file_of("client-key"),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
    )


class ApiError(Exception):
    """A failed API call, with the server's HTTP status and `Status` reason."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


def resource_path(
    api_version: str,
    plural: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """`/apis/apps/v1/namespaces/ns/deployments/name` and the like; no namespace means all."""
    path = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespace is not None:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    if name is not None:
        path += f"/{name}"
    if subresource is not None:
        path += f"/{subresource}"
    return path


class KubeClient:
    """JSON in, JSON out. Use as `async with KubeClient(config) as client:`."""

    def __init__(self, config: KubeConfig, timeout: float = 30.0) -> None:
        self.config = config
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> KubeClient:
        ssl_context: ssl.SSLContext | bool = False
        if self.config.server.startswith("https://"):
            ssl_context = ssl.create_default_context(cafile=self.config.ca_file)
            if self.config.insecure:
                ssl_context.check_hostname = False
                ssl_context.verify_mode = ssl.CERT_NONE
            if self.config.cert_file:
                ssl_context.load_cert_chain(self.config.cert_file, self.config.key_file)
        connector = aiohttp.TCPConnector(ssl=ssl_context, limit=64)
        # Watch events arrive one object per line; allow objects up to 1 MiB per line.
        self._session = aiohttp.ClientSession(
            self.config.server, connector=connector, read_bufsize=2**20
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        token = self.config.bearer_token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """One call; raises `ApiError` for any answer but 2xx."""
        if self._session is None:
            raise RuntimeError("KubeClient is used outside `async with`")
        data = None if body is None else json.dumps(body)
        async with self._session.request(
            method,
            path,
            data=data,
            params=params,
            headers=self._headers(content_type if body is not None else None),
            timeout=self._timeout,
        ) as response:
            text = await response.text()
            if response.status >= 300:
                raise _error(response.status, text)
            return json.loads(text) if text else {}

    async def get(self, path: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self.request("GET", path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, path: str, label_selector: str | None = None) -> dict[str, Any]:
        params = {"labelSelector": label_selector} if label_selector else None
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, body)

    async def patch(self, path: str, body: Any, content_type: str = MERGE_PATCH) -> dict[str, Any]:
        return await self.request("PATCH", path, body, content_type=content_type)

    async def delete(self, path: str) -> None:
        """Deletes in the background (dependents are garbage-collected); absent is fine."""
        try:
            options = {
                "apiVersion": "v1",
                "kind": "DeleteOptions",
                "propagationPolicy": "Background",
            }
            await self.request("DELETE", path, options)
        except ApiError as e:
            if e.status != 404:
                raise

    async def watch(
        self,
        path: str,
        resource_version: str,
        label_selector: str | None = None,
        timeout_seconds: int = 300,
    ) -> AsyncIterator[dict[str, Any]]:
        """Watch events (`{"type": ..., "object": ...}`) after `resource_version` until the
        server ends the stream; an `ERROR` event (e.g. 410 Gone) raises `ApiError`."""
        if self._session is None:
            raise RuntimeError("KubeClient is used outside `async with`")
        params = {
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
        }
        if label_selector:
            params["labelSelector"] = label_selector
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout_seconds + 30)
        async with self._session.get(
            path, params=params, headers=self._headers(), timeout=timeout
        ) as response:
            if response.status >= 300:
                raise _error(response.status, await response.text())
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object", {})
                    raise ApiError(
                        status.get("code", 500), status.get("reason", ""), status.get("message", "")
                    )
                yield event


def _error(status: int, text: str) -> ApiError:
    try:
        payload = json.loads(text)
        return ApiError(status, payload.get("reason", ""), payload.get("message", text))
    except (ValueError, AttributeError):
        return ApiError(status, "", text[:500])
