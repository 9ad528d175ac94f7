"""`baton router`: flags to configs and discovery, the real command in a process, and the
rule that the router never loads torch or engine code."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from baton.router import cli
from baton.router.config import RouterConfig
from baton.router.discovery import StaticDiscovery
from tests.router.harness import FakeCluster
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_args(parser)
    return parser.parse_args(argv)


def test_policy_flags_set_each_role() -> None:
    """--policy sets both roles; --prefill-policy/--decode-policy override it per role."""
    config = cli.config_from_args(
        _parse("--policy", "least-load", "--decode-policy", "round-robin")
    )
    assert (config.prefill_policy, config.decode_policy) == ("least-load", "round-robin")
    assert cli.config_from_args(_parse()) == RouterConfig()
    with pytest.raises(ValueError, match="disagg_cached_fraction"):
        cli.config_from_args(_parse("--disagg-cached-fraction", "0"))


def test_key_flags_and_their_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's own key (--api-key, else $BATON_API_KEY) goes to its listener, the engines'
    (--upstream-api-key, else $BATON_UPSTREAM_API_KEY) to its `RouterConfig`, with the CA
    bundle for https engines; https:// static URLs are engines like any other."""
    monkeypatch.setenv("BATON_API_KEY", "router-env")
    monkeypatch.setenv("BATON_UPSTREAM_API_KEY", "engine-env")
    args = _parse("--engine", "https://10.0.0.1:8000", "--upstream-ca-certs", "ca.pem")
    assert cli.listen_from_args(args).api_keys == ("router-env",)
    config = cli.config_from_args(args)
    assert (config.upstream_api_key, config.upstream_ca_certs) == ("engine-env", "ca.pem")
    discovery = cli.discovery_from_args(args)
    assert isinstance(discovery, StaticDiscovery)
    assert [e.url for e in discovery.endpoints] == ["https://10.0.0.1:8000"]
    args = _parse("--engine", "http://e:1", "--api-key", "r", "--upstream-api-key", "e")
    assert cli.listen_from_args(args).api_keys == ("r",)
    assert cli.config_from_args(args).upstream_api_key == "e"
    monkeypatch.delenv("BATON_UPSTREAM_API_KEY")
    assert cli.config_from_args(_parse("--engine", "http://e:1")).upstream_api_key is None


def test_static_discovery_from_urls() -> None:
    """URL flags become endpoints of their roles; none at all is an error."""
    args = _parse("--prefill", "http://p:1/", "--decode", "http://d:1", "--engine", "http://b:1")
    discovery = cli.discovery_from_args(args)
    assert isinstance(discovery, StaticDiscovery)
    assert {(e.url, e.role) for e in discovery.endpoints} == {
        ("http://p:1", "prefill"),
        ("http://d:1", "decode"),
        ("http://b:1", "both"),
    }
    with pytest.raises(ValueError, match="at least one engine"):
        cli.discovery_from_args(_parse())


def test_kubernetes_discovery_flags_are_checked() -> None:
    """Kubernetes discovery needs a namespace or --all-namespaces, and no static URLs."""
    with pytest.raises(ValueError, match="--namespace"):
        cli.discovery_from_args(_parse("--discovery", "kubernetes"))
    with pytest.raises(ValueError, match="static"):
        cli.discovery_from_args(_parse("--discovery", "kubernetes", "--engine", "http://b:1"))
    assert cli.parse_selector("app=baton, role = decode,") == {"app": "baton", "role": "decode"}
    k8s = cli.discovery_from_args(
        _parse("--discovery", "kubernetes", "--namespace", "serving", "--selector", "app=baton")
    )
    assert type(k8s).__name__ == "KubernetesDiscovery"
    assert (k8s.namespace, k8s.selector) == ("serving", "app=baton")  # type: ignore[attr-defined]
    everywhere = cli.discovery_from_args(
        _parse("--discovery", "kubernetes", "--all-namespaces", "--selector", "app=baton")
    )
    assert everywhere.namespace is None  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="key=value"):
        cli.parse_selector("app")


def test_importing_the_router_loads_neither_torch_nor_the_engine() -> None:
    """`import baton.router.app` (and the CLI) in a fresh process leaves torch unloaded."""
    code = (
        "import sys, baton.router.app, baton.router.cli; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('baton.engine')]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_baton_router_command_serves_and_stops(cluster: FakeCluster, tmp_path: Path) -> None:
    """`baton router --engine URL` in its own process routes a request without loading torch,
    then exits 0 on SIGTERM."""
    _, engine = cluster.add()
    port = free_port()
    log = tmp_path / "router.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "baton.cli", "router", "--host", "127.0.0.1",
             "--port", str(port), "--engine", engine.url],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        body = {"model": "fake", "prompt": "x", "max_tokens": 3}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body).json()
        assert answer["choices"][0]["text"].count(" t") == 3
        # The router never loads torch (checked on the running process, after a request).
        assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()
        proc.terminate()
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
