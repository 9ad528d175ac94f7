"""Fixtures of the TCP transport tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from baton.kv_transfer.tcp.server import KVBlockServer
from tests.kv_transfer.helpers import ENGINE, make_cache
from tests.support.kv_wire import KEYS


@pytest.fixture
def server() -> Iterator[KVBlockServer]:
    srv = KVBlockServer(make_cache(), ENGINE, KEYS)
    srv.start()
    yield srv
    srv.stop()
