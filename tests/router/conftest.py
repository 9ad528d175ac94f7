"""Fixtures of the router's tests: a cluster of fake engines, stopped after each test, and the
emulated Kubernetes API server that discovery watches."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from baton.operator import crd
from tests.router.harness import FakeCluster
from tests.support.kmock_server import ApiServer


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    c = FakeCluster()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture()
def api(tmp_path: Path) -> Iterator[tuple[ApiServer, str]]:
    """The emulated API server and a kubeconfig for it."""
    server = ApiServer().start()
    server.declare(crd.GROUP, crd.VERSION, crd.PLURAL, crd.KIND, True, ("status",))
    yield server, str(server.write_kubeconfig(tmp_path / "kubeconfig"))
    server.stop()
