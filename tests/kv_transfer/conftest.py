"""Fixtures of the TCP transport tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from baton.kv_transfer.tcp.server import KVBlockServer
from tests.kv_transfer.helpers import ENGINE, make_cache


@pytest.fixture
def server() -> Iterator[KVBlockServer]:
    srv = KVBlockServer(make_cache(), ENGINE)
    srv.start()
    yield srv
    srv.stop()
