"""The per-service hand-off Secret against the emulated API server: created once with a fresh
secret, never written again (a second pass, a restarted operator and a user's rotation leave it
as it is), a Secret made beforehand used as it is, mounted read-only into prefill and decode
pods with `--kv-secret-file`, and absent from aggregated services, whose pods run no KV server."""

from __future__ import annotations

import argparse
import asyncio
import base64
import re
from pathlib import Path
from typing import Any

from baton.engine.api.cli import add_server_args, configs_from_args
from baton.kube import connect
from baton.operator.api import Api
from baton.operator.pods import engine_args
from baton.operator.reconciler import Reconciler
from baton.operator.resources import MANAGER
from baton.operator.spec import parse_spec
from tests.operator.conftest import Kube

NS = "serving"
SECRET = f"/api/v1/namespaces/{NS}/secrets/llama-kv-secret"
SECRETS = f"/api/v1/namespaces/{NS}/secrets"
DEPLOYMENT = f"/apis/apps/v1/namespaces/{NS}/deployments/llama-{{}}"
SPEC: dict[str, Any] = {"model": {"uri": "hf://acme/llama-8b"}, "image": "b:1"}
MOUNT = {"name": "kv-secret", "mountPath": "/etc/baton/kv-secret", "readOnly": True}


def passes(kube: Kube, tmp_path: Path, count: int = 1, restart: bool = False) -> None:
    """`count` reconcile passes of llama by one reconciler (and, with `restart`, one more by a
    fresh reconciler, as a restarted operator's first pass)."""

    async def main() -> None:
        cluster = await connect(str(kube.server.write_kubeconfig(tmp_path / "kubeconfig")))
        try:
            reconciler = Reconciler(Api(cluster))
            for _ in range(count):
                await reconciler.reconcile(NS, "llama")
            if restart:
                await Reconciler(Api(cluster)).reconcile(NS, "llama")
        finally:
            await cluster.close()

    asyncio.run(main())


def secret(kube: Kube) -> dict[str, Any]:
    found = kube.get(SECRET)
    assert found is not None, "no hand-off Secret"
    return found


def keys(obj: dict[str, Any]) -> str:
    return base64.b64decode(obj["data"]["keys"]).decode()


def ready_reason(kube: Kube) -> str:
    isvc = kube.isvc(NS, "llama")
    assert isvc is not None
    (ready,) = [c for c in isvc["status"]["conditions"] if c["type"] == "Ready"]
    return str(ready["reason"])


def test_a_fresh_secret_is_created_once(kube: Kube, tmp_path: Path) -> None:
    """A disaggregated service gets an owned Opaque Secret holding one 64-hex secret line; a
    second pass and a restarted operator's pass leave it byte for byte as it was."""
    owner = kube.apply_isvc(NS, "llama", SPEC)
    passes(kube, tmp_path)
    created = secret(kube)
    assert created["type"] == "Opaque"
    assert re.fullmatch(r"[0-9a-f]{64}\n", keys(created))
    meta = created["metadata"]
    assert meta["labels"]["baton.dev/inference-service"] == "llama"
    assert meta["labels"]["app.kubernetes.io/managed-by"] == MANAGER
    assert [(r["kind"], r["uid"], r["controller"]) for r in meta["ownerReferences"]] == [
        ("InferenceService", owner["metadata"]["uid"], True)
    ]
    passes(kube, tmp_path, count=2, restart=True)
    assert secret(kube) == created


def test_two_services_get_different_secrets(kube: Kube, tmp_path: Path) -> None:
    """Each service's secret is its own random value."""
    kube.apply_isvc(NS, "llama", SPEC)
    kube.apply_isvc("other", "llama", SPEC)
    passes(kube, tmp_path)

    async def other() -> None:
        cluster = await connect(str(kube.server.write_kubeconfig(tmp_path / "kubeconfig")))
        try:
            await Reconciler(Api(cluster)).reconcile("other", "llama")
        finally:
            await cluster.close()

    asyncio.run(other())
    theirs = kube.get("/api/v1/namespaces/other/secrets/llama-kv-secret")
    assert theirs is not None and keys(theirs) != keys(secret(kube))


def test_a_users_rotation_survives_reconciles(kube: Kube, tmp_path: Path) -> None:
    """A user who adds a second line and moves it first keeps exactly that after a pass of the
    same operator and of a restarted one."""
    kube.apply_isvc(NS, "llama", SPEC)
    passes(kube, tmp_path)
    old = keys(secret(kube)).strip()
    rotated = f"{'ab' * 32}\n{old}\n"
    kube.patch(SECRET, {"data": {"keys": base64.b64encode(rotated.encode()).decode()}})
    edited = secret(kube)
    passes(kube, tmp_path, count=2, restart=True)
    assert secret(kube) == edited and keys(edited) == rotated


def test_a_secret_made_beforehand_is_used_as_it_is(kube: Kube, tmp_path: Path) -> None:
    """A Secret of that name that the user made (not controlled by the service) is neither
    overwritten nor refused as a conflict; the pods mount it."""
    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "llama-kv-secret", "namespace": NS},
        "type": "Opaque",
        "data": {"keys": base64.b64encode(b"mine\n").decode()},
    }
    assert kube.http.post(SECRETS, json=body).status_code == 201
    mine = secret(kube)
    kube.apply_isvc(NS, "llama", SPEC)
    passes(kube, tmp_path, count=2)
    assert secret(kube) == mine
    assert ready_reason(kube) != "ChildConflict"
    assert kube.get(DEPLOYMENT.format("decode")) is not None


def test_a_concurrent_creation_counts_as_done(kube: Kube, tmp_path: Path) -> None:
    """When the Secret appears between the operator's read and its create (another pass, or
    the user), the create's 409 AlreadyExists ends the pass normally and changes nothing."""
    kube.apply_isvc(NS, "llama", SPEC)
    passes(kube, tmp_path)
    before = secret(kube)

    class Blind(Api):
        """Sees no Secrets, so the reconciler tries to create the one that exists."""

        async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
            return (
                None if kind == "Secret" else await super().get(api_version, kind, namespace, name)
            )

    async def main() -> None:
        cluster = await connect(str(kube.server.write_kubeconfig(tmp_path / "kubeconfig")))
        try:
            await Reconciler(Blind(cluster)).reconcile(NS, "llama")
        finally:
            await cluster.close()

    asyncio.run(main())
    assert secret(kube) == before


def test_prefill_and_decode_pods_mount_it(kube: Kube, tmp_path: Path) -> None:
    """Both pools mount the Secret read-only at /etc/baton/kv-secret, readable by the pods'
    group only (fsGroup 10001, mode 0440), and pass --kv-secret-file; the router does not."""
    kube.apply_isvc(NS, "llama", SPEC)
    passes(kube, tmp_path)
    for pool in ("prefill", "decode"):
        live = kube.get(DEPLOYMENT.format(pool))
        assert live is not None
        pod = live["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        args = container["args"]
        assert args[args.index("--kv-secret-file") + 1] == "/etc/baton/kv-secret/keys"
        assert MOUNT in container["volumeMounts"]
        volume = {"secretName": "llama-kv-secret", "defaultMode": 0o440}
        assert {"name": "kv-secret", "secret": volume} in pod["volumes"]
        assert pod["securityContext"]["fsGroup"] == 10001
    router = kube.get(DEPLOYMENT.format("router"))
    assert router is not None
    assert "kv-secret" not in {v["name"] for v in router["spec"]["template"]["spec"]["volumes"]}


def test_an_aggregated_service_gets_no_secret(kube: Kube, tmp_path: Path) -> None:
    """An aggregated service hands no KV between engines: no Secret, and its engine pods get
    neither the mount nor the flag, nor a KV transport (no KV server listens at all)."""
    kube.apply_isvc(NS, "llama", SPEC | {"mode": "aggregated"})
    passes(kube, tmp_path)
    assert kube.get(SECRET) is None
    live = kube.get(DEPLOYMENT.format("engine"))
    assert live is not None
    pod = live["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "kv-secret" not in {v["name"] for v in pod["volumes"]}
    assert MOUNT not in container["volumeMounts"]
    hand_off = [a for a in container["args"] if a.startswith("--kv-") and a != "--kv-events-config"]
    assert not hand_off  # KV events are not a hand-off: aggregated engines publish them too
    assert [p["name"] for p in container["ports"]] == ["http", "kv-events", "kv-replay"]
    service = kube.get(f"/api/v1/namespaces/{NS}/services/llama-engine")
    assert service is not None and [p["name"] for p in service["spec"]["ports"]] == ["http"]


def test_the_engine_parser_takes_the_operators_args() -> None:
    """The args the operator gives each pool are ones `baton engine` accepts: prefill and decode
    get a KV transport and the secret file, the aggregated pool no KV transport at all."""
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    for mode, pools in (("disaggregated", ("prefill", "decode")), ("aggregated", ("both",))):
        spec = parse_spec(SPEC | {"mode": mode})
        for pool in spec.pools:
            args = parser.parse_args(engine_args(spec, pool)[1:])  # [0] is the subcommand
            engine, _ = configs_from_args(args)
            assert pool.role in pools
            if pool.role == "both":
                assert engine.kv_transfer is None
            else:
                assert engine.kv_transfer is not None and engine.kv_transfer.role == pool.role
                assert args.kv_secret_file == "/etc/baton/kv-secret/keys"
