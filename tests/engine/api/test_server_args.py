"""The engine server's flags: they become `EngineArgs` and `ServerConfig`, and bad values fail."""

from __future__ import annotations

import argparse
from pathlib import Path

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
    """--role and --kv-* land in `KVTransferConfig` (the transport auto unless given); 0.0.0.0
    advertises loopback unless told."""
    engine, _ = configs_from_args(
        _parse("--role", "prefill", "--host", "0.0.0.0", "--kv-port", "14579",
               "--kv-lease-seconds", "5", "--kv-load-failure-policy", "fail")
    )  # fmt: skip
    kv = engine.kv_transfer
    assert kv is not None
    assert (kv.role, kv.transport, kv.host, kv.port) == ("prefill", "auto", "0.0.0.0", 14579)
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


def test_key_and_tls_flags_reach_the_server_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """--api-key (several allowed, else $BATON_API_KEY) and --ssl-* land in `ServerConfig`;
    an empty key or a key file without its certificate fails."""
    monkeypatch.setenv("BATON_API_KEY", "from-env")
    _, server = configs_from_args(_parse())
    assert server.api_keys == ("from-env",)
    _, server = configs_from_args(
        _parse("--api-key", "new", "old", "--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem",
               "--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs", "2")
    )  # fmt: skip
    assert server.api_keys == ("new", "old")
    assert (server.ssl_certfile, server.ssl_keyfile) == ("c.pem", "k.pem")
    assert (server.ssl_ca_certs, server.ssl_cert_reqs) == ("ca.pem", 2)
    assert "new" not in repr(server)
    with pytest.raises(ValueError, match="empty"):
        configs_from_args(_parse("--api-key", ""))
    with pytest.raises(ValueError, match="ssl_certfile"):
        configs_from_args(_parse("--ssl-keyfile", "k.pem"))


def test_chat_template_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    """--chat-template, as vLLM's: a file's contents, or the value when it reads as Jinja;
    anything else is a usage error naming it, not a template that renders the name."""
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    engine, _ = configs_from_args(_parse("--chat-template", str(path)))
    assert engine.chat_template == "{{ messages[0]['content'] }}"
    engine, _ = configs_from_args(_parse("--chat-template", "{% for m in messages %}x{% endfor %}"))
    assert engine.chat_template == "{% for m in messages %}x{% endfor %}"
    assert configs_from_args(_parse())[0].chat_template is None
    with pytest.raises(SystemExit):
        _parse("--chat-template", str(tmp_path / "missing.jinja"))


def test_a_long_template_or_a_long_name_is_not_a_crash() -> None:
    """A template longer than a path may be is the template; a long name that is neither is
    a usage error, not an OSError from the file system."""
    long_template = "{{ messages[0]['content'] }}" + "x" * 5000
    assert configs_from_args(_parse("--chat-template", long_template))[0].chat_template == (
        long_template
    )
    with pytest.raises(SystemExit):
        _parse("--chat-template", "n" * 300)


def test_structured_outputs_config_flag() -> None:
    """vLLM's --structured-outputs-config JSON: compact JSON unless asked otherwise; unknown keys
    and backends are refused by the parser, naming them."""
    engine, _ = configs_from_args(_parse())
    assert engine.structured_outputs_config.disable_any_whitespace is True
    engine, _ = configs_from_args(
        _parse("--structured-outputs-config", '{"disable_any_whitespace": false}')
    )
    assert engine.structured_outputs_config.disable_any_whitespace is False
    for bad in ('{"bogus": 1}', '{"backend": "xgrammar"}', "[1]", "not json"):
        with pytest.raises(SystemExit):
            _parse("--structured-outputs-config", bad)
