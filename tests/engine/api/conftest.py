"""Fixtures of the API server tests: the tiny model and one shared server per test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.api.server_fixtures import Server, start_server


@pytest.fixture(scope="module")
def model(tiny_model: Any) -> Path:
    return Path(tiny_model("llama"))


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(model, tmp_path_factory.mktemp("server"), "--max-body-bytes", "100000")
    try:
        yield s
    finally:
        s.stop()
