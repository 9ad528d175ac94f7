"""Fixtures for the operator tests: the emulated API server, a client for it, and the operator
running as its own process against it."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from baton.operator import crd
from tests.support.kmock_server import ApiServer

ISVC_PATH = f"/apis/{crd.API_VERSION}/namespaces/{{ns}}/{crd.PLURAL}"


def wait_for(check: Callable[[], Any], timeout: float = 90.0, what: str = "condition") -> Any:
    """Polls `check` until it returns something truthy; fails the test after `timeout`, which
    covers an operator process's start on two cores busy with the rest of the suite (over 30 s
    seen once in a full run)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


class Kube:
    """Synchronous test-side access to the emulated API server."""

    def __init__(self, server: ApiServer) -> None:
        self.server = server
        self.http = httpx.Client(base_url=server.url, timeout=10, headers=server.headers())

    def apply_isvc(self, ns: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        body = {
            "apiVersion": crd.API_VERSION,
            "kind": crd.KIND,
            "metadata": {"name": name, "namespace": ns},
            "spec": spec,
        }
        response = self.http.post(ISVC_PATH.format(ns=ns), json=body)
        assert response.status_code == 201, response.text
        return response.json()  # type: ignore[no-any-return]

    def patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/merge-patch+json"}
        response = self.http.patch(path, json=body, headers=headers)
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]

    def get(self, path: str) -> dict[str, Any] | None:
        response = self.http.get(path)
        return response.json() if response.status_code == 200 else None

    def delete(self, path: str) -> None:
        assert self.http.delete(path).status_code == 200

    def isvc(self, ns: str, name: str) -> dict[str, Any] | None:
        return self.get(f"{ISVC_PATH.format(ns=ns)}/{name}")

    def names(self, plural: str, ns: str) -> set[str]:
        return {o["metadata"]["name"] for o in self.server.objects(plural, ns)}


@contextlib.contextmanager
def emulated(token: str | None = None) -> Iterator[Kube]:
    """A fresh emulated API server that serves the InferenceService CRD (and, with `token`,
    accepts only that bearer token)."""
    server = ApiServer(token=token).start()
    server.declare(crd.GROUP, crd.VERSION, crd.PLURAL, crd.KIND, True, ("status",))
    client = Kube(server)
    try:
        wait_for(lambda: client.http.get(f"/apis/{crd.API_VERSION}").status_code == 200)
        yield client
    finally:
        client.http.close()
        server.stop()


@pytest.fixture()
def kube() -> Iterator[Kube]:
    """A fresh emulated API server that serves the InferenceService CRD."""
    with emulated() as client:
        yield client


@pytest.fixture()
def start_operator(kube: Kube, tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Starts `baton operator` as a separate process against `kube` (through `kubeconfig`, by
    default one with the server's token); stops it at the end."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str, kubeconfig: Path | None = None) -> subprocess.Popen[bytes]:
        kubeconfig = kubeconfig or kube.server.write_kubeconfig(tmp_path / "kubeconfig")
        log = (tmp_path / f"operator-{len(started)}.log").open("wb")
        command = [sys.executable, "-m", "baton.cli", "operator", "--kubeconfig", str(kubeconfig)]
        process = subprocess.Popen(
            [*command, "--health-port", "0", *args], stdout=log, stderr=subprocess.STDOUT
        )
        started.append(process)
        return process

    yield start
    for process in started:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
