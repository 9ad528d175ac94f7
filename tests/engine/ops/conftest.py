"""Fixtures for the kernel tests; without CUDA, switches Triton to its CPU interpreter.

Triton reads ``TRITON_INTERPRET`` when ``triton.jit`` decorates a function: for its own helpers
(``tl.cdiv``, ``tl.max``...) at ``import triton``, for Baton's kernels at their first launch.
So triton must not be imported before this file sets the variable. ``baton.engine.ops`` imports
triton only on first launch, so importing it earlier is harmless; any other module that imports
triton at import time, collected before this directory, breaks the CPU runs (a warning below
says so). A suite-wide ``tests/conftest.py`` setting the variable would rule that out.
"""

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    if "triton" in sys.modules:
        warnings.warn(
            "triton was imported before tests/engine/ops/conftest.py could set "
            "TRITON_INTERPRET=1; the CPU kernel tests will fail. Set it in the environment.",
            stacklevel=1,
        )
    os.environ["TRITON_INTERPRET"] = "1"

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

_CPU = pytest.param(
    "cpu",
    marks=pytest.mark.skipif(
        not _INTERPRET, reason="Triton runs on CPU only with TRITON_INTERPRET=1"
    ),
)
_CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ],
)


@pytest.fixture(params=[_CPU, _CUDA])
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each kernel test runs on CPU (interpreter) and on CUDA; the one that cannot run skips."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    """Seed each test, and restore the global RNG after it so later tests do not depend on ours."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


# Runs in a fresh process: with TRITON_INTERPRET=1, triton.language's own jitted helpers
# (tl.cdiv, tl.max...) are interpreter wrappers that the compiler cannot inline.
_COMPILE_SCRIPT = """
import importlib, json, sys
from baton.engine.ops.launch import jit
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

for job in json.loads(sys.stdin.read()):
    module = importlib.import_module(job["module"])
    fn = jit(getattr(module, job["kernel"]))  # a JITFunction: no interpreter here
    signature = {}
    for name in fn.arg_names:
        if name in job["constexprs"]:
            signature[name] = "constexpr"
        elif name in job["pointers"]:
            signature[name] = "*" + job["pointers"][name]
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    source = ASTSource(fn, signature, constexprs=job["constexprs"])
    compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": job["num_warps"]})
    print("compiled", job["kernel"], flush=True)
"""


def _compile_for_hopper(jobs: list[dict[str, Any]]) -> None:
    """Compile Baton kernels for sm_90 with Triton's bundled ptxas in a subprocess; no GPU needed.

    Each job names ``module``, ``kernel`` (the undecorated function, which ``launch.jit``
    decorates), ``pointers`` (argument name to element type, "fp16", "i32"...), ``constexprs``
    and ``num_warps``; ``qk_scale`` is fp32 and other arguments i32. Skips where this Triton has
    no bundled ptxas.
    """
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton has no bundled ptxas to compile for sm_90 with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    if result.returncode != 0:
        pytest.fail(f"compiling for sm_90 failed:\n{result.stdout}\n{result.stderr[-4000:]}")


@pytest.fixture
def compile_for_hopper() -> Callable[[list[dict[str, Any]]], None]:
    """Compiles kernels as on an H100/H200, so CPU runs catch what only the compiler rejects."""
    if torch.cuda.is_available():
        pytest.skip("the CUDA tests compile and run the kernels for this GPU")
    return _compile_for_hopper
