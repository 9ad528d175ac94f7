"""Fixtures of the router's tests: a cluster of fake engines, stopped after each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.router.harness import FakeCluster


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    c = FakeCluster()
    try:
        yield c
    finally:
        c.stop()
