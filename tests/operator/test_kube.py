"""The small API client: where credentials come from, and how calls and watches behave."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import pytest

from baton.operator import kube
from baton.operator.kube import ApiError, KubeClient, load_config, resource_path
from tests.operator.kmock_server import ApiServer


def kubeconfig(tmp_path: Path, user: dict, cluster: dict | None = None) -> str:
    doc = {
        "clusters": [{"name": "c", "cluster": {"server": "https://k:6443/"} | (cluster or {})}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "ns"}}],
        "current-context": "x",
    }
    path = tmp_path / "config"
    path.write_text(json.dumps(doc))
    return str(path)


def test_kubeconfig_with_token_and_inline_certificates(tmp_path: Path) -> None:
    """Tokens are read as they are; inline CA and client certificates are written to files."""
    pem = base64.b64encode(b"-----PEM-----").decode()
    config = load_config(
        kubeconfig(
            tmp_path,
            {"token": "t", "client-certificate-data": pem, "client-key": "key.pem"},
            {"certificate-authority-data": pem},
        )
    )
    assert (config.server, config.namespace, config.bearer_token()) == ("https://k:6443", "ns", "t")
    assert config.ca_file and Path(config.ca_file).read_bytes() == b"-----PEM-----"
    assert config.cert_file and Path(config.cert_file).read_bytes() == b"-----PEM-----"
    assert config.key_file == str(tmp_path / "key.pem")


def test_in_cluster_service_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a pod, the service account's token file (re-read every time) and CA are used."""
    (tmp_path / "token").write_text("first\n")
    (tmp_path / "namespace").write_text("serving")
    monkeypatch.setattr(kube, "SERVICE_ACCOUNT", tmp_path)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    config = load_config()
    assert (config.server, config.namespace) == ("https://10.96.0.1:443", "serving")
    assert config.bearer_token() == "first"
    (tmp_path / "token").write_text("rotated")
    assert config.bearer_token() == "rotated"


def test_exec_plugins_are_refused_with_a_reason(tmp_path: Path) -> None:
    """A kubeconfig user that needs an exec plugin is refused with a message that says so."""
    with pytest.raises(ValueError, match="exec"):
        load_config(kubeconfig(tmp_path, {"exec": {"command": "aws"}}))


def test_calls_and_watch_against_the_emulator(tmp_path: Path) -> None:
    """get returns None for a missing object, errors carry the status, and a watch from a
    list's resourceVersion sees the changes made after it."""
    server = ApiServer().start()
    try:
        config = load_config(str(server.write_kubeconfig(tmp_path / "kubeconfig")))

        async def main() -> None:
            async with KubeClient(config) as client:
                path = resource_path("v1", "services", "a")
                assert await client.get(f"{path}/missing") is None
                body = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}}
                await client.create(path, body)
                with pytest.raises(ApiError) as info:
                    await client.create(path, body)
                assert info.value.status == 409
                listed = await client.list(path)
                version = listed["metadata"]["resourceVersion"]
                await client.patch(f"{path}/s", {"metadata": {"labels": {"x": "1"}}})
                async for event in client.watch(path, version, timeout_seconds=1):
                    assert event["type"] == "MODIFIED"
                    assert event["object"]["metadata"]["labels"] == {"x": "1"}
                    break
                await client.delete(f"{path}/s")
                await client.delete(f"{path}/s")  # absent is fine

        asyncio.run(main())
    finally:
        server.stop()
