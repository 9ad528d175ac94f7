"""Ports a process picks for servers it starts itself and must name before they bind (`baton
serve`'s engines, their KV event publishers, a tensor-parallel group's rendezvous).

Picked outside the kernel's ephemeral range (``net.ipv4.ip_local_port_range``): the kernel takes
the local port of every outgoing connection, and of every bind to port 0, from that range, so a
port picked there and free at the pick could be taken by any connection before its server bound
it (which CI saw as engines failing to start on "address already in use"). Below the range, only
a process that picks the same number can take it: the pick is random (not the seeded
``random``, which test runners reset to one seed in every process) and checked free by binding.
"""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000  # below this, well-known services; leave them be
_TRIES = 200

_given: set[int] = set()  # every port this process handed out: never twice


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now, below the ephemeral range where the
    machine leaves room (else the kernel's own pick), and not handed out before by this
    process."""
    low, high = _LOWEST, _ephemeral_start()
    for _ in range(_TRIES if high - low >= 1000 else 0):
        port = low + secrets.randbelow(high - low)
        if port not in _given and _bindable(host, port):
            _given.add(port)
            return port
    while True:
        port = _bindable(host, 0)
        if port not in _given:
            _given.add(port)
            return port


def _bindable(host: str, port: int) -> int:
    """The port a bind to (host, port) got, or 0 when it failed."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return 0
        return int(s.getsockname()[1])


def _ephemeral_start() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
