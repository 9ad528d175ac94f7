"""The engine's API server process stays thin: after serving completions and a chat request it
has not loaded libtorch (only its EngineCore process has), read from /proc on the processes."""

from __future__ import annotations

from pathlib import Path

from tests.support.engine_server import NAME, Server
from tests.support.procs import engine_core_pid


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) / 1024


def test_api_server_process_never_loads_torch(server: Server) -> None:
    """Tokenizing, chat templating, detokenizing and streaming all run without torch in the
    API server; the core beside it holds the model (and torch). (The package's shared server:
    whatever the other tests sent it has not pulled torch in either.)"""
    client = server.client()
    text = client.completions.create(model=NAME, prompt="The relay team", max_tokens=8)
    assert text.choices[0].text
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
    )
    assert any(chunk.choices and chunk.choices[0].delta.content for chunk in chat)
    core = engine_core_pid(server.proc.pid)
    assert "libtorch" in _maps(core)  # the check can see torch where it is
    assert "libtorch" not in _maps(server.proc.pid)
    # Far below what importing torch alone costs (~250 MiB here).
    assert _rss_mib(server.proc.pid) < 150
