"""Which KV transport an engine uses: `auto` takes NIXL where it imports and serves the KV cache's
memory and TCP otherwise, an explicit `nixl` without NIXL stops the engine's start with a message
that says what to install (never a silent TCP), and the choice shows in /health and
`baton:engine_info`."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from baton.engine.async_llm import AsyncLLM
from baton.engine.config import EngineArgs
from baton.kv_transfer.base import KVTransferConfig
from baton.kv_transfer.connector import (
    TransportUnavailableError,
    choose_transport,
    make_transport,
    nixl_import_error,
)
from tests.support.engine_server import ROOT, Server
from tests.support.kv_wire import KEYS

NIXL_MODULE = "baton.kv_transfer.nixl.transport"
HAS_NIXL = nixl_import_error() is None
needs_nixl = pytest.mark.skipif(not HAS_NIXL, reason="no NIXL package imports here")


@pytest.fixture
def no_nixl(monkeypatch: pytest.MonkeyPatch) -> None:
    """NIXL cannot be imported in this process (a None entry makes the import fail)."""
    monkeypatch.setitem(sys.modules, NIXL_MODULE, None)


@pytest.fixture(scope="module")
def hidden_nixl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a child process in which no NIXL package imports: packages of the same
    names, found first on PYTHONPATH, raise ImportError as a missing or broken install does."""
    shadow = tmp_path_factory.mktemp("no-nixl")
    for name in ("nixl", "nixl_cu12", "nixl_cu13"):
        (shadow / name).mkdir()
        (shadow / name / "__init__.py").write_text(f"raise ImportError('{name} is hidden')\n")
    path = os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


@pytest.fixture(scope="module")
def model(tiny_model: Any) -> Path:
    return Path(tiny_model("llama"))


def test_explicit_nixl_without_nixl_fails(no_nixl: None) -> None:
    """make_transport for --kv-transport nixl raises, naming the import failure and the fix,
    instead of handing back a TCP transport."""
    with pytest.raises(TransportUnavailableError) as err:
        make_transport(KVTransferConfig(role="prefill", transport="nixl"), KEYS)
    message = str(err.value)
    assert "NIXL cannot be imported" in message and NIXL_MODULE in message
    assert "baton[nixl]" in message and "--kv-transport tcp" in message


def test_auto_without_nixl_uses_tcp_and_says_why(
    no_nixl: None, caplog: pytest.LogCaptureFixture
) -> None:
    """auto becomes TCP where NIXL does not import, and the log line says so."""
    with caplog.at_level(logging.INFO, logger="baton.kv_transfer.connector"):
        transport = make_transport(KVTransferConfig(role="decode"), KEYS)
    assert transport.name == "tcp"
    assert "KV transport tcp (auto: NIXL cannot be imported" in caplog.text


@needs_nixl
def test_auto_with_nixl_uses_nixl(caplog: pytest.LogCaptureFixture) -> None:
    """auto is the default, and takes NIXL where it imports (host memory: DRAM)."""
    assert KVTransferConfig().transport == "auto"
    with caplog.at_level(logging.INFO, logger="baton.kv_transfer.connector"):
        transport = make_transport(KVTransferConfig(role="decode"), KEYS)
    assert transport.name == "nixl"
    assert "KV transport nixl (auto: NIXL imports and registers DRAM memory)" in caplog.text
    assert choose_transport("auto", "cuda") == (
        "nixl",
        "auto: NIXL imports and registers VRAM memory",
    )


def test_memory_the_nixl_transport_does_not_register() -> None:
    """A KV cache on a device whose memory the NIXL transport does not register: auto takes
    TCP, an explicit nixl fails naming the device; tcp stays tcp."""
    name, why = choose_transport("auto", "mps")
    assert name == "tcp" and "this KV cache is on mps" in why
    with pytest.raises(TransportUnavailableError, match="this KV cache is on mps"):
        choose_transport("nixl", "mps")
    assert choose_transport("tcp", "cuda")[0] == "tcp"


def test_engine_core_start_fails_through_the_handshake(
    model: Path, hidden_nixl: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine core whose NIXL does not import reports the explicit-nixl failure as a failed
    start (the handshake's Failed), with the message, and exits."""
    monkeypatch.setenv("PYTHONPATH", hidden_nixl["PYTHONPATH"])
    kvt = KVTransferConfig(role="prefill", transport="nixl")
    args = EngineArgs(model=str(model), max_model_len=256, block_size=8, kv_transfer=kvt)
    with pytest.raises(ValueError, match="the engine failed to start") as err:
        asyncio.run(asyncio.wait_for(AsyncLLM.start(args), 120))
    assert "TransportUnavailableError: --kv-transport nixl: NIXL cannot be imported" in str(
        err.value
    )
    assert "nixl_cu12 is hidden" in str(err.value)


def test_engine_server_with_nixl_missing_exits(model: Path, hidden_nixl: dict[str, str]) -> None:
    """`--kv-transport nixl` where NIXL does not import: the server's start fails (its core
    reports it in the handshake) and it exits non-zero with the message."""
    cmd = [
        sys.executable, "-m", "baton.engine.api.cli", "--model", str(model),
        "--max-model-len", "256", "--port", "0", "--role", "prefill", "--kv-transport", "nixl",
    ]  # fmt: skip
    done = subprocess.run(
        cmd, env=hidden_nixl, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "--kv-transport nixl: NIXL cannot be imported" in output, output
    assert "pip install 'baton[nixl]'" in output, output


def _engine_info(server: Server) -> dict[str, str]:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith("baton:engine_info{"))
    return dict(re.findall(r'(\w+)="([^"]*)"', line))


@pytest.fixture(scope="module")
def auto_servers(
    model: Path, hidden_nixl: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Server]]:
    """Prefill engines on the default transport: one where NIXL imports (if it does here), one
    where it does not."""
    tmp = tmp_path_factory.mktemp("auto")
    servers: dict[str, Server] = {}
    saved = os.environ.get("PYTHONPATH")
    try:
        if HAS_NIXL:
            servers["nixl"] = Server(model, tmp / "nixl.log", "--role", "prefill")
        os.environ["PYTHONPATH"] = hidden_nixl["PYTHONPATH"]  # Server passes its environment on
        servers["tcp"] = Server(model, tmp / "tcp.log", "--role", "prefill")
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    try:
        for server in servers.values():
            server.wait_ready(180)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.mark.parametrize("transport", ["nixl", "tcp"])
def test_auto_choice_is_reported(auto_servers: dict[str, Server], transport: str) -> None:
    """An engine on auto reports the transport it picked in /health and baton:engine_info."""
    if transport not in auto_servers:
        pytest.skip("no NIXL package imports here")
    server = auto_servers[transport]
    health = httpx.get(f"{server.url}/health", timeout=5).json()
    assert (health["role"], health["kv_transport"]) == ("prefill", transport)
    info = _engine_info(server)
    assert (info["role"], info["kv_transport"]) == ("prefill", transport)
