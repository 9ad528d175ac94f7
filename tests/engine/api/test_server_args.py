"""The engine server's flags: they become `EngineArgs` and `ServerConfig`, and bad values fail."""

from __future__ import annotations

import argparse

import pytest

from baton.engine.api.cli import add_server_args, configs_from_args


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return parser.parse_args(list(argv))


def test_flags_reach_the_configs() -> None:
    """Server flags land in `ServerConfig`, engine flags in `EngineArgs`; an aggregated engine
    without --kv-transport has no KV connector."""
    engine, server = configs_from_args(
        _parse("--port", "9001", "--max-waiting-requests", "4", "--max-num-seqs", "8")
    )
    assert (server.port, server.max_waiting_requests) == (9001, 4)
    assert engine.max_num_seqs == 8
    assert engine.kv_transfer is None


def test_role_flags_make_the_kv_transfer_config() -> None:
    """--role and --kv-* land in `KVTransferConfig`; 0.0.0.0 advertises loopback unless told."""
    engine, _ = configs_from_args(
        _parse("--role", "prefill", "--host", "0.0.0.0", "--kv-port", "14579",
               "--kv-lease-seconds", "5", "--kv-load-failure-policy", "fail")
    )  # fmt: skip
    kv = engine.kv_transfer
    assert kv is not None
    assert (kv.role, kv.transport, kv.host, kv.port) == ("prefill", "tcp", "0.0.0.0", 14579)
    assert (kv.public_host, kv.lease_seconds, kv.load_failure_policy) == ("127.0.0.1", 5.0, "fail")
    engine, _ = configs_from_args(
        _parse("--role", "decode", "--kv-advertise-host", "10.0.0.7", "--kv-transport", "nixl")
    )
    assert engine.kv_transfer is not None
    assert (engine.kv_transfer.public_host, engine.kv_transfer.transport) == ("10.0.0.7", "nixl")
    engine, _ = configs_from_args(_parse("--kv-transport", "tcp"))
    assert engine.kv_transfer is not None and engine.kv_transfer.role == "both"


def test_bad_kv_flags_fail() -> None:
    """Unknown roles and policies are refused by the parser; nonsense numbers by the config."""
    with pytest.raises(SystemExit):
        _parse("--role", "prefiller")
    with pytest.raises(SystemExit):
        _parse("--kv-load-failure-policy", "ignore")
    with pytest.raises(ValueError, match="lease seconds"):
        configs_from_args(_parse("--role", "prefill", "--kv-lease-seconds", "0"))


def test_tensor_parallel_flags() -> None:
    """--tensor-parallel-size (or -tp) picks the multiprocess executor, for prefill and decode
    engines too; a fixed --kv-port is rank 0's, rank r serves on port + r."""
    engine, _ = configs_from_args(_parse("--tensor-parallel-size", "2"))
    assert (engine.tensor_parallel_size, engine.executor_backend) == (2, "mp")
    engine, _ = configs_from_args(_parse("-tp", "1", "--distributed-executor-backend", "mp"))
    assert (engine.tensor_parallel_size, engine.executor_backend) == (1, "mp")
    engine, _ = configs_from_args(_parse("--role", "decode", "-tp", "2", "--kv-port", "7000"))
    assert engine.tensor_parallel_size == 2 and engine.kv_transfer is not None
    assert [engine.kv_transfer.for_rank(r).port for r in range(2)] == [7000, 7001]
    assert engine.kv_transfer.for_rank(1).rank == 1
