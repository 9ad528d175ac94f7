"""The engine server's flags: they become `EngineArgs` and `ServerConfig`, and bad values fail."""

from __future__ import annotations

import argparse

import pytest

from baton.engine.api.server import ServerConfig, add_server_args, configs_from_args


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return parser.parse_args(list(argv))


def test_flags_reach_the_configs() -> None:
    """Server flags land in `ServerConfig`, engine flags in `EngineArgs`; role defaults to both."""
    engine, server = configs_from_args(
        _parse("--port", "9001", "--max-waiting-requests", "4", "--max-num-seqs", "8")
    )
    assert (server.port, server.max_waiting_requests, server.role) == (9001, 4, "both")
    assert engine.max_num_seqs == 8
    _, server = configs_from_args(_parse("--role", "both"))
    assert server.role == "both"


def test_only_the_both_role_exists_for_now() -> None:
    """Prefill and decode roles come with the KV connector: the flag and the config refuse them."""
    with pytest.raises(SystemExit):
        _parse("--role", "prefill")
    with pytest.raises(ValueError, match="role must be 'both'"):
        ServerConfig(role="decode")
