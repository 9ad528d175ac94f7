"""The KV path canary against the emulated API server and fake engines over real HTTP: the
pools' EndpointSlices point at fake engines on 127.0.0.1, the canary runs a real two-step
hand-off between them, and `KVPathReady` and `status.kvPath` say what it found (a failed pull,
unequal fingerprints, a NIXL service on TCP, a stuck engine that never slows a reconcile)."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from baton.kube import connect
from baton.operator.api import Api
from baton.operator.canary import CanaryConfig
from baton.operator.reconciler import Reconciler
from tests.operator.conftest import Kube
from tests.support.fake_engine import FakeEngine, LeaseBoard
from tests.support.kmock_server import endpoint_slice
from tests.support.thread_server import ThreadServer

NS = "serving"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
SPEC: dict[str, Any] = {"model": {"uri": "hf://acme/llama-8b"}, "image": "b:1"}
MODEL = "acme/llama-8b"  # the served name of SPEC
FAST = CanaryConfig(interval_seconds=0.3, timeout_seconds=2.0, retry_seconds=0.1)


class Pair:
    """A fake prefill and a fake decode engine that share leases, each on its own port."""

    def __init__(self) -> None:
        board = LeaseBoard()
        self.prefill = FakeEngine(MODEL, "prefill", board)
        self.decode = FakeEngine(MODEL, "decode", board)
        self.servers = [ThreadServer(e.app).start() for e in (self.prefill, self.decode)]
        for engine, server in zip((self.prefill, self.decode), self.servers, strict=True):
            engine.port = server.port
            engine.kv_transport = "tcp"
        self.decode.pull_seconds = 0.01

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture()
def pair() -> Iterator[Pair]:
    engines = Pair()
    yield engines
    engines.stop()


def run(
    kube: Kube,
    tmp_path: Path,
    body: Callable[[Reconciler], Awaitable[None]],
    config: CanaryConfig = FAST,
) -> None:
    async def main() -> None:
        cluster = await connect(str(kube.server.write_kubeconfig(tmp_path / "kubeconfig")))
        reconciler = Reconciler(Api(cluster), canary=config)
        try:
            await body(reconciler)
        finally:
            await reconciler.close()
            await cluster.close()

    asyncio.run(main())


def make_ready(kube: Kube, pair: Pair) -> None:
    """What Kubernetes would do once the pods run: ready Deployments, and EndpointSlices of the
    headless Services with the (fake) pods' addresses, here 127.0.0.1 and each fake's port."""
    for component, engine in (("prefill", pair.prefill), ("decode", pair.decode)):
        status = {"readyReplicas": 1, "replicas": 1}
        kube.patch(f"{DEPLOYMENTS}/llama-{component}/status", {"status": status})
        service = kube.get(f"/api/v1/namespaces/{NS}/services/llama-{component}")
        assert service is not None
        slice_ = endpoint_slice(service, {"127.0.0.1": True}, port=engine.port)
        assert kube.http.post(SLICES, json=slice_).status_code == 201


def kv_ready(kube: Kube) -> dict[str, Any]:
    isvc = kube.isvc(NS, "llama") or {}
    for cond in (isvc.get("status") or {}).get("conditions", []):
        if cond["type"] == "KVPathReady":
            return dict(cond)
    return {}


async def until(check: Callable[[], Any], timeout: float = 5.0, what: str = "it") -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
    return found


def reason_is(kube: Kube, reason: str) -> Callable[[], dict[str, Any] | None]:
    """A check for `until`: the KVPathReady condition once it has `reason`."""

    def check() -> dict[str, Any] | None:
        found = kv_ready(kube)
        return found if found.get("reason") == reason else None

    return check


def test_a_failed_pull_then_a_working_pair(kube: Kube, tmp_path: Path, pair: Pair) -> None:
    """Nothing ready: False (PoolsNotReady); a decode engine whose pull fails: False
    (CanaryHandOffFailed, policy fail, a Warning Event); once the pull works: True with the
    transport, bytes, GB/s, latency and engines in `kvPath`. `Ready` never depends on it."""
    kube.apply_isvc(NS, "llama", SPEC)
    pair.decode.pull_failure = "CHECKSUM_MISMATCH"

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")
        assert kv_ready(kube)["status"] == "False"
        assert kv_ready(kube)["reason"] == "PoolsNotReady"
        make_ready(kube, pair)
        await reconciler.trigger(NS, "llama")
        failed = await until(reason_is(kube, "CanaryHandOffFailed"), what="the failure")
        assert failed["status"] == "False" and "CHECKSUM_MISMATCH" in failed["message"]
        step2 = pair.decode.requests[-1]["kv_transfer_params"]
        assert step2["kv_load_failure_policy"] == "fail" and step2["do_remote_prefill"]
        pair.decode.pull_failure = None
        await until(reason_is(kube, "CanaryHandOffSucceeded"), what="a working pair")

    run(kube, tmp_path, body)
    isvc = kube.isvc(NS, "llama")
    assert isvc is not None
    status = isvc["status"]
    assert kv_ready(kube)["status"] == "True"
    path = status["kvPath"]
    assert path["transport"] == "tcp" and path["requestedTransport"] == "auto"  # the default
    assert path["succeeded"] is True and path["consecutiveFailures"] == 0
    assert path["bytes"] > 0 and path["bytes"] % pair.decode.block_bytes == 0
    assert path["latencyMs"] == pytest.approx(10.0, abs=0.5)  # the fake pull's 0.01 s
    assert path["gbPerSecond"] == pytest.approx(path["bytes"] / 0.01 / 1e9, rel=0.05)
    assert path["prefillEngine"] == f"127.0.0.1:{pair.prefill.port}"
    assert path["decodeEngine"] == f"127.0.0.1:{pair.decode.port}"
    assert path["lastCheckTime"].endswith("Z")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "ComponentsNotReady" and "KV" not in ready["message"]
    reasons = [e.get("reason") for e in kube.server.objects("events", NS)]
    assert "CanaryHandOffFailed" in reasons


def test_unequal_fingerprints_hand_nothing_off(kube: Kube, tmp_path: Path, pair: Pair) -> None:
    """Engines whose /health fingerprints differ: IncompatibleEngines, and neither engine got a
    request (the canary checks before it leases anything)."""
    kube.apply_isvc(NS, "llama", SPEC)
    pair.prefill.fingerprint, pair.decode.fingerprint = "a" * 16, "b" * 16

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")
        make_ready(kube, pair)
        await reconciler.trigger(NS, "llama")
        found = await until(reason_is(kube, "IncompatibleEngines"), what="IncompatibleEngines")
        assert found["status"] == "False" and "a" * 16 in found["message"]

    run(kube, tmp_path, body)
    assert pair.prefill.requests == [] and pair.decode.requests == []


def test_a_nixl_service_on_tcp_says_it_fell_back(kube: Kube, tmp_path: Path, pair: Pair) -> None:
    """The spec asks for nixl, the engines' /health says tcp: False (TransportFellBack) with
    the hand-off's numbers measured over the transport really used; with an API key, which
    the canary reads from spec.apiKeySecret and sends as a bearer token."""
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "llama-key", "namespace": NS},
        "data": {"key": base64.b64encode(b"sk-test\n").decode()},
    }
    assert kube.http.post(f"/api/v1/namespaces/{NS}/secrets", json=secret).status_code == 201
    spec = {**SPEC, "kvTransfer": {"transport": "nixl"}}
    spec["apiKeySecret"] = {"name": "llama-key", "key": "key"}
    kube.apply_isvc(NS, "llama", spec)
    pair.prefill.api_key = pair.decode.api_key = "sk-test"

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")
        make_ready(kube, pair)
        await reconciler.trigger(NS, "llama")
        found = await until(reason_is(kube, "TransportFellBack"), what="TransportFellBack")
        assert found["status"] == "False" and "nixl" in found["message"]

    run(kube, tmp_path, body)
    isvc = kube.isvc(NS, "llama")
    assert isvc is not None
    path = isvc["status"]["kvPath"]
    assert (path["transport"], path["requestedTransport"]) == ("tcp", "nixl")
    assert path["bytes"] > 0 and pair.decode.remote_decodes >= 1


def test_a_stuck_canary_leaves_the_reconcile_unaffected(
    kube: Kube, tmp_path: Path, pair: Pair
) -> None:
    """While a decode engine hangs in step 2, reconcile passes take their usual time and apply a
    spec edit; the canary gives up after its timeout: CanaryHandOffFailed."""
    kube.apply_isvc(NS, "llama", SPEC)
    pair.decode.ttft = 30.0
    config = CanaryConfig(interval_seconds=30, timeout_seconds=1.0, retry_seconds=0.1)

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")
        make_ready(kube, pair)
        await reconciler.trigger(NS, "llama")
        await until(lambda: pair.decode.in_flight, what="the canary's step 2")
        isvc = f"/apis/baton.dev/v1alpha1/namespaces/{NS}/inferenceservices/llama"
        kube.patch(isvc, {"spec": {"router": {"replicas": 3}}})
        started = time.monotonic()
        await reconciler.trigger(NS, "llama")
        assert time.monotonic() - started < 0.9  # under the canary's timeout
        assert pair.decode.in_flight  # the canary still waits
        assert (kube.get(f"{DEPLOYMENTS}/llama-router") or {})["spec"]["replicas"] == 3
        found = await until(reason_is(kube, "CanaryHandOffFailed"), what="the timeout")
        assert "within 1s" in found["message"]

    run(kube, tmp_path, body, config)


def test_an_aggregated_service_has_no_kv_path(kube: Kube, tmp_path: Path) -> None:
    """Aggregated engines hand nothing off: no KVPathReady, no kvPath, no canary."""
    kube.apply_isvc(NS, "llama", {**SPEC, "mode": "aggregated"})

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")

    run(kube, tmp_path, body)
    isvc = kube.isvc(NS, "llama")
    assert isvc is not None and "kvPath" not in isvc["status"]
    assert kv_ready(kube) == {}
