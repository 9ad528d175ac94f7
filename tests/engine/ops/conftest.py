"""Fixtures for the kernel tests; without CUDA, switches Triton to its CPU interpreter.

Triton chooses between compiling and interpreting a kernel when ``triton.jit`` decorates it, by
reading ``TRITON_INTERPRET`` at that moment. ``baton.engine.ops`` decorates its kernels on first
launch, so setting the variable here is enough even if another test module imported the ops (or
triton) earlier. A module that decorates kernels at import time is different: it must not be
imported before this file runs; a suite-wide ``tests/conftest.py`` doing the same would cover it.
"""

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
def _seed() -> None:
    torch.manual_seed(0)


# Runs in a fresh process: with TRITON_INTERPRET=1, triton.language's own jitted helpers
# (tl.cdiv, tl.max...) are interpreter wrappers that the compiler cannot inline.
_COMPILE_SCRIPT = """
import importlib, json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from triton.runtime.jit import JITFunction

for job in json.loads(sys.stdin.read()):
    fn = JITFunction(getattr(importlib.import_module(job["module"]), job["kernel"]))
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

    Each job names ``module``, ``kernel`` (the undecorated function), ``pointers`` (argument
    name to element type, "fp16", "i32"...), ``constexprs`` and ``num_warps``; ``qk_scale`` is
    fp32 and other arguments i32. Skips where this Triton lacks the ahead-of-time API or ptxas.
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
