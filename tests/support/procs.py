"""Probes of processes from /proc: children, liveness, resident memory, the EngineCore child."""

from __future__ import annotations

import time
from pathlib import Path


def children(pid: int) -> list[int]:
    """Child process ids of `pid` (the EngineCore is one of an engine server's)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry.name))
    return kids


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_exit(pid: int, timeout: float) -> float:
    """Seconds until `pid` has ended; fails after `timeout`."""
    start = time.monotonic()
    while alive(pid):
        assert time.monotonic() - start < timeout, f"process {pid} still runs after {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - start


def rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def engine_core_pid(server_pid: int) -> int:
    """The EngineCore process of the engine server `server_pid`."""
    for pid in children(server_pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"baton.engine.core_proc" in cmdline:
            return pid
    raise AssertionError(f"no EngineCore child of {server_pid}")
