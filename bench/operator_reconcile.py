"""Reconcile latency of the operator: the time from applying an InferenceService to all of its
children existing, for one service at a time and for 100 applied at once. The operator runs as
its own process against the emulated API server of the tests (kmock), on this machine.

    python bench/operator_reconcile.py [--single 10] [--batch 100]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the emulator lives in the test support code

from baton.operator import crd  # noqa: E402
from tests.support.kmock_server import ApiServer  # noqa: E402

# Disaggregated, no autoscaling: 3 Deployments, 3 Services, 3 PDBs, SA, Role, RoleBinding, the
# service's NetworkPolicy and its hand-off Secret.
CHILDREN = 14
SPEC = {"model": {"uri": "hf://acme/llama-8b"}, "image": "baton:bench"}


def apply(http: httpx.Client, ns: str, name: str) -> float:
    body = {
        "apiVersion": crd.API_VERSION,
        "kind": crd.KIND,
        "metadata": {"name": name, "namespace": ns},
        "spec": SPEC,
    }
    started = time.monotonic()
    response = http.post(f"/apis/{crd.API_VERSION}/namespaces/{ns}/{crd.PLURAL}", json=body)
    response.raise_for_status()
    return started


def finished(server: ApiServer, ns: str) -> dict[str, float]:
    """Service name -> when its last child was created, for services with every child."""
    count: dict[str, int] = {}
    last: dict[str, float] = {}
    for (_, _, _, namespace, child), created in list(server.handler.created.items()):
        if namespace != ns:
            continue
        # "b7" is the router Service, "b7-prefill" etc. the rest; the service names have no "-".
        owner = child.split("-", 1)[0]
        count[owner] = count.get(owner, 0) + 1
        last[owner] = max(last.get(owner, 0.0), created)
    return {owner: last[owner] for owner, n in count.items() if n >= CHILDREN}


def wait_all(server: ApiServer, ns: str, names: list[str], timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        done = finished(server, ns)
        if all(name in done for name in names):
            return {name: done[name] for name in names}
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(done)}/{len(names)} services reconciled in {timeout}s")
        time.sleep(0.01)


def summary(label: str, seconds: list[float]) -> str:
    ms = sorted(s * 1000 for s in seconds)
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    return (
        f"{label:<34} n={len(ms):<4} p50={statistics.median(ms):7.1f} ms  "
        f"p90={p90:7.1f} ms  max={ms[-1]:7.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--single", type=int, default=10, help="one-at-a-time applies")
    parser.add_argument("--batch", type=int, default=100, help="services applied at once")
    args = parser.parse_args()

    server = ApiServer().start()
    server.declare(crd.GROUP, crd.VERSION, crd.PLURAL, crd.KIND, True, ("status",))
    workdir = Path(tempfile.mkdtemp(prefix="baton-bench-"))
    kubeconfig = server.write_kubeconfig(workdir / "kubeconfig")
    command = [sys.executable, "-m", "baton.cli", "--log-level", "WARNING", "operator"]
    operator = subprocess.Popen(
        [*command, "--all-namespaces", "--kubeconfig", str(kubeconfig), "--health-port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=(workdir / "operator.log").open("wb"),
    )
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            apply(http, "warmup", "w")  # also waits out the operator's start-up
            wait_all(server, "warmup", ["w"], timeout=60)

            single = []
            for i in range(args.single):
                started = apply(http, "single", f"s{i}")
                single.append(wait_all(server, "single", [f"s{i}"], 30)[f"s{i}"] - started)

            names = [f"b{i}" for i in range(args.batch)]
            applied = {name: apply(http, "batch", name) for name in names}
            done = wait_all(server, "batch", names, timeout=300)
            first = min(applied.values())
            print(f"operator reconcile latency (apply -> all {CHILDREN} children exist)")
            print(summary("1 service at a time", single))
            print(
                summary(
                    f"{args.batch} services applied at once", [done[n] - applied[n] for n in names]
                )
            )
            total = max(done.values()) - first
            print(
                f"{args.batch} services: first apply to last child {total:.2f} s "
                f"(applying took {max(applied.values()) - first:.2f} s)"
            )
    finally:
        operator.terminate()
        operator.wait(10)
        server.stop()


if __name__ == "__main__":
    main()
