"""Probes of processes from /proc: children, liveness, resident memory, the EngineCore child;
and `Process`, a handle that signals one process and never a later one that reuses its id."""

from __future__ import annotations

import contextlib
import os
import select
import signal
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


def state(pid: int) -> str:
    """The state letter of `pid` in /proc (R running, S sleeping, T stopped, Z zombie...);
    OSError once it is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie has ended)."""
    try:
        return state(pid) != "Z"
    except OSError:
        return False


def wait_exit(process: int | Process, timeout: float) -> float:
    """Seconds until `process` has ended; fails after `timeout`."""
    start = time.monotonic()
    running = process.running if isinstance(process, Process) else lambda: alive(process)
    while running():
        assert time.monotonic() - start < timeout, f"{process} still runs after {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - start


def port_taken(log: Path) -> int:
    """How many times a server's log says a start found its port taken (uvicorn's bind error)."""
    return log.read_text(errors="replace").count("address already in use")


def listens(pid: int, port: int) -> bool:
    """True when `pid` holds the socket that listens on TCP `port` (IPv4): a server that
    answers on a port may be another process that picked the same number first."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
            inodes.add(f"socket:[{fields[9]}]")
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) in inodes:
                    return True
    return False


def rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


class Process:
    """One process held by a pidfd, opened while it runs. A pid held as a number and signalled
    later may name another process by then: ids are reused (pid_max is 32768 here, and every
    thread takes one), and `kill` of a thread's id signals that thread's whole process, so a
    stale SIGKILL once killed a test's bystander engine. A pidfd signals this process or none."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd = os.pidfd_open(pid)  # ProcessLookupError when it has ended already

    def signal(self, sig: int) -> bool:
        """Sends `sig`; False when the process has ended."""
        try:
            signal.pidfd_send_signal(self._fd, sig)
        except ProcessLookupError:
            return False
        return True

    def running(self) -> bool:
        """True until the process exits (a zombie has exited)."""
        return not select.select([self._fd], [], [], 0)[0]

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.close(self._fd)


def opened(pids: list[int]) -> list[Process]:
    """Handles of those of `pids` that still run."""
    handles = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            handles.append(Process(pid))
    return handles


def engine_core(server_pid: int) -> Process:
    """The EngineCore child of the engine server `server_pid`, as a handle."""
    return Process(engine_core_pid(server_pid))


def engine_core_pid(server_pid: int) -> int:
    """The EngineCore process of the engine server `server_pid`."""
    for pid in children(server_pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"baton.engine.core_proc" in cmdline:
            return pid
    raise AssertionError(f"no EngineCore child of {server_pid}")
