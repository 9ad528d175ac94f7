"""Where `baton.kube` gets credentials: kubeconfig users with a token, inline certificates or an
exec plugin, several kubeconfig files merged, the pod's service account; and connecting."""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.config import incluster_config
from kubernetes_asyncio.dynamic.exceptions import UnauthorizedError

from baton import kube
from baton.kube import connect, load_configuration
from tests.support.exec_credential import exec_user
from tests.support.kmock_server import ApiServer


def kubeconfig(tmp_path: Path, user: dict[str, Any], cluster: dict[str, Any] | None = None) -> str:
    doc = {
        "clusters": [{"name": "c", "cluster": {"server": "https://k:6443"} | (cluster or {})}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "ns"}}],
        "current-context": "x",
    }
    path = tmp_path / "config"
    path.write_text(json.dumps(doc))
    return str(path)


async def bearer(kubeconfig_path: str | None = None) -> tuple[str | None, str]:
    configuration, namespace = await load_configuration(kubeconfig_path)
    return await configuration.get_api_key_with_prefix("BearerToken"), namespace


def test_kubeconfig_with_token_and_inline_certificates(tmp_path: Path) -> None:
    """Tokens are read as they are; inline CA and client certificates are written to files, and
    a relative key path is taken from the kubeconfig's folder."""
    pem = base64.b64encode(b"-----PEM-----").decode()
    path = kubeconfig(
        tmp_path,
        {"token": "t", "client-certificate-data": pem, "client-key": "key.pem"},
        {"certificate-authority-data": pem},
    )
    (tmp_path / "key.pem").write_text("key")

    async def main() -> None:
        configuration, namespace = await load_configuration(path)
        assert (configuration.host, namespace) == ("https://k:6443", "ns")
        assert await configuration.get_api_key_with_prefix("BearerToken") == "Bearer t"
        assert Path(configuration.ssl_ca_cert).read_bytes() == b"-----PEM-----"
        assert Path(configuration.cert_file).read_bytes() == b"-----PEM-----"
        assert configuration.key_file == str(tmp_path / "key.pem")

    asyncio.run(main())


def test_several_kubeconfig_files_are_merged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`$KUBECONFIG` may list several files, as kubectl reads it: one names the cluster and the
    user, another the context that uses them."""
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (first / "config").write_text(
        json.dumps(
            {
                "clusters": [{"name": "c", "cluster": {"server": "https://far:6443"}}],
                "users": [{"name": "u", "user": {"token": "merged"}}],
            }
        )
    )
    (second / "config").write_text(
        json.dumps(
            {
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", f"{first / 'config'}:{second / 'config'}")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")  # KUBECONFIG wins over it
    assert asyncio.run(bearer()) == ("Bearer merged", "default")


def test_in_cluster_service_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a pod, the service account's token (re-read as the kubelet rotates it), CA and
    namespace are used."""
    (tmp_path / "token").write_text("first")
    (tmp_path / "namespace").write_text("serving")
    (tmp_path / "ca.crt").write_text("-----CA-----")
    monkeypatch.setattr(kube, "SERVICE_ACCOUNT", tmp_path)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    # The library re-reads the file once a minute; make that every time.
    monkeypatch.setattr(incluster_config, "TOKEN_REFRESH_PERIOD", datetime.timedelta(0))

    async def main() -> None:
        configuration, namespace = await load_configuration()
        assert (configuration.host, namespace) == ("https://10.96.0.1:443", "serving")
        assert configuration.ssl_ca_cert == str(tmp_path / "ca.crt")
        assert await configuration.get_api_key_with_prefix("BearerToken") == "Bearer first"
        (tmp_path / "token").write_text("rotated")
        assert await configuration.get_api_key_with_prefix("BearerToken") == "Bearer rotated"

    asyncio.run(main())


def test_exec_plugin_token_is_kept_until_it_expires(tmp_path: Path) -> None:
    """An exec plugin's token is used as it is while valid; a token about to expire makes the
    next request run the plugin again."""
    lasting = kubeconfig(tmp_path, exec_user(tmp_path, "tok-", expires_in=3600, numbered=True))

    async def tokens(path: str) -> list[str | None]:
        configuration, _ = await load_configuration(path)
        return [await configuration.get_api_key_with_prefix("BearerToken") for _ in range(2)]

    assert asyncio.run(tokens(lasting)) == ["Bearer tok-1", "Bearer tok-1"]
    (tmp_path / "plugin-runs").unlink()
    expiring = kubeconfig(tmp_path, exec_user(tmp_path, "tok-", expires_in=1, numbered=True))
    assert asyncio.run(tokens(expiring)) == ["Bearer tok-2", "Bearer tok-3"]


def test_a_missing_kubeconfig_says_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither a kubeconfig nor a cluster: the error names the path."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        asyncio.run(load_configuration(str(tmp_path / "nowhere")))


def test_connect_refuses_credentials_the_server_refuses(tmp_path: Path) -> None:
    """Connecting with the server's token works; with another one it fails with 401 at once,
    not later inside API discovery."""
    server = ApiServer(token="right").start()
    try:

        async def main() -> None:
            cluster = await connect(str(server.write_kubeconfig(tmp_path / "good")))
            assert cluster.namespace == "default"
            await cluster.close()
            bad = server.write_kubeconfig(tmp_path / "bad", user={"token": "wrong"})
            with pytest.raises(UnauthorizedError):
                await connect(str(bad))

        asyncio.run(main())
        assert server.handler.refused == 1
    finally:
        server.stop()
