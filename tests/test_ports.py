"""The port picker of `baton serve`, the tensor-parallel rendezvous and the tests' stacks: below
the kernel's ephemeral range, free when picked, never handed out twice."""

from __future__ import annotations

import random
import socket

import pytest

from baton import ports


def test_picks_free_ports_below_the_ephemeral_range_and_never_twice() -> None:
    start = ports._ephemeral_start()
    picked = [ports.free_port() for _ in range(300)]
    assert len(set(picked)) == len(picked)
    if start - ports._LOWEST >= 1000:
        assert all(ports._LOWEST <= p < start for p in picked)
    for port in picked[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when handed out


def test_a_seeded_random_does_not_repeat_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Test runners seed `random` alike in every worker; the picker does not draw from it: three
    fresh processes' first picks (each after the same seed) are not all the same port."""
    firsts = []
    for _ in range(3):
        monkeypatch.setattr(ports, "_given", set())
        random.seed(1)
        firsts.append(ports.free_port())
    assert len(set(firsts)) > 1


def test_falls_back_to_the_kernels_pick_without_room(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: ports._LOWEST + 10)
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
