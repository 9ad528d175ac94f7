"""Fixtures for the kernel tests; without CUDA, switches Triton to its CPU interpreter.

Triton chooses between compiling and interpreting a kernel when ``triton.jit`` decorates it, by
reading ``TRITON_INTERPRET`` at that moment. ``baton.engine.ops`` decorates its kernels on first
launch, so setting the variable here is enough even if another test module imported the ops (or
triton) earlier. A module that decorates kernels at import time is different: it must not be
imported before this file runs; a suite-wide ``tests/conftest.py`` doing the same would cover it.
"""

import os
from collections.abc import Callable
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


def _compile_for_hopper(
    kernel: Callable[..., None],
    pointers: dict[str, str],
    constexprs: dict[str, Any],
    num_warps: int = 4,
) -> Any:
    """Compile an undecorated Baton kernel for sm_90 with Triton's bundled ptxas; no GPU needed.

    Arguments in ``pointers`` get that element type ("fp16", "i32"...), ``qk_scale`` fp32, the
    rest i32. Skips where this Triton lacks the ahead-of-time API or the NVIDIA backend.
    """
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile
        from triton.runtime.jit import JITFunction
    except ImportError as e:
        pytest.skip(f"this Triton has no ahead-of-time compile API: {e}")
    fn = JITFunction(kernel)  # not triton.jit: that returns the interpreter's wrapper here
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    source = ASTSource(fn, signature, constexprs=constexprs)
    try:
        return compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    except (FileNotFoundError, RuntimeError) as e:
        if "ptxas" in str(e) or "backend" in str(e).lower():
            pytest.skip(f"no NVIDIA backend to compile with: {e}")
        raise


@pytest.fixture
def compile_for_hopper() -> Callable[..., Any]:
    """Compiles kernels as on an H100/H200, so CPU runs catch what only the compiler rejects."""
    return _compile_for_hopper
