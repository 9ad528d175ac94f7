"""Fixtures of the API server tests: the tiny model, and one server for the whole package,
shared by the tests that only send it requests (a test that kills, drains or reconfigures a
server starts its own)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.engine_server import Server, start_server


@pytest.fixture(scope="package")
def model(tiny_model: Any) -> Path:
    return Path(tiny_model("llama"))


@pytest.fixture(scope="package")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(model, tmp_path_factory.mktemp("server"), "--max-body-bytes", "100000")
    try:
        yield s
    finally:
        s.stop()
