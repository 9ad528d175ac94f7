"""Resident memory of the processes that should stay thin: a running `baton engine`'s API server
process (beside its EngineCore process, which holds the model), and `baton router`; and whether
each maps libtorch. Read from outside, from /proc, after each answers /health.

    python bench/frontend_memory.py [--model PATH] [--json out.json]

Run it in two checkouts to compare (each line names the checkout it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from baton.ports import free_port


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def _measure(name: str, pid: int) -> dict[str, object]:
    return {
        "process": name,
        "pid": pid,
        "rss_mib": round(_rss_mib(pid), 1),
        "libtorch": _maps_torch(pid),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder (default: a tiny Llama written for this run)")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    baton = [sys.executable, "-m", "baton.cli"]
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = str(Path(tmp) / "tiny")
            subprocess.run([*baton, "tiny-model", model], check=True, capture_output=True)
        engine_port, router_port = free_port(), free_port()
        engine = subprocess.Popen(
            [*baton, "engine", "--model", model, "--host", "127.0.0.1", "--port", str(engine_port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        router = None
        try:
            _wait_healthy(f"http://127.0.0.1:{engine_port}", engine)
            time.sleep(1)  # let start-up garbage settle
            rows.append(_measure("engine API server", engine.pid))
            for child in _children(engine.pid):
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
                if b"resource_tracker" not in cmdline:  # multiprocessing's, in older checkouts
                    rows.append(_measure("engine core", child))
            engine_url = f"http://127.0.0.1:{engine_port}"
            router_cmd = [*baton, "router", "--port", str(router_port), "--engine", engine_url]
            router = subprocess.Popen(
                [*router_cmd, "--host", "127.0.0.1"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            _wait_healthy(f"http://127.0.0.1:{router_port}", router)
            time.sleep(1)
            rows.append(_measure("router", router.pid))
        finally:
            for proc in (router, engine):
                if proc is not None:
                    proc.terminate()
                    proc.wait(30)
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for row in rows:
        name, rss, torch = row["process"], row["rss_mib"], row["libtorch"]
        print(f"{checkout}  {name:<18} RSS {rss:>7} MiB  libtorch {torch}")
    if args.json:
        Path(args.json).write_text(json.dumps({"checkout": checkout, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
