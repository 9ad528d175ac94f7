"""How long Baton takes to become ready, against issue 23's aims, with what a start is made of
measured in the same run: a bare `import torch`, the API's imports, one `baton engine` on the
tiny test model and `baton serve` (router, one prefill and one decode engine) on the default
model, each from process start to its /health answering 200, with warm caches (one unmeasured
start first fills them: the C kernel, the prepared GGUF folder, the dequantized copy).

    python bench/startup.py [--runs 3] [--no-serve] [--json PATH]

Aims: an engine on the tiny model ready in at most 5 s; `make serve` (the default model) ready
in at most 10 s after the first run. Printed as measured/aim: at most 1.0 meets the aim.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENGINE_AIM_S, SERVE_AIM_S = 5.0, 10.0


def time_to_ready(argv: list[str], url: str, env: dict[str, str], timeout: float = 300) -> float:
    """Seconds from starting `argv` to `url` answering 200 (polled every 10 ms); then the
    process group is stopped."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        while time.perf_counter() - start < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[:3]} exited with {proc.returncode} before ready")
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                pass
            time.sleep(0.01)
        raise TimeoutError(f"{argv[:3]} not ready in {timeout} s")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def time_command(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-serve", action="store_true", help="skip baton serve")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from baton.engine.models.tiny import write_tiny_model
    from baton.ports import free_port

    py, baton = sys.executable, str(Path(sys.executable).with_name("baton"))
    env = dict(os.environ)
    work = Path(tempfile.mkdtemp(prefix="baton-startup-"))
    env.setdefault("BATON_CACHE_DIR", str(work / "cache"))
    tiny = write_tiny_model(work / "tiny", "llama", "tiny")

    def engine() -> float:
        port = free_port()
        argv = [baton, "engine", "--model", str(tiny), "--port", str(port)]
        return time_to_ready(argv, f"http://127.0.0.1:{port}/health", env)

    def serve() -> float:
        port = free_port()
        argv = [baton, "serve", "--port", str(port)]
        return time_to_ready(argv, f"http://127.0.0.1:{port}/health", env)

    parts = {
        "import torch": lambda: time_command([py, "-c", "import torch"], env),
        "import the API server": lambda: time_command(
            [py, "-c", "import baton.engine.api.server"], env
        ),
        "engine ready (tiny model)": engine,
    }
    if not args.no_serve:
        parts["baton serve ready (default model)"] = serve
    results: dict[str, list[float]] = {}
    for name, fn in parts.items():
        fn()  # fills the caches; not counted
        results[name] = [fn() for _ in range(args.runs)]
    print(f"{args.runs} runs each after one warm-up, {os.cpu_count()} cores, seconds")
    for name, times in results.items():
        print(f"  {name:36s} median {statistics.median(times):6.2f}  runs {times}")
    aims = {
        "engine ready (tiny model)": ENGINE_AIM_S,
        "baton serve ready (default model)": SERVE_AIM_S,
    }
    for name, aim in aims.items():
        if name in results:
            ratio = statistics.median(results[name]) / aim
            print(
                f"  {name}: {ratio:.2f}x the {aim:.0f} s aim ({'met' if ratio <= 1 else 'missed'})"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
