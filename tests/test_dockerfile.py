"""The Dockerfile's promises, read from the file (no image is built here: the machines that run
the tests have no container daemon): a cpu and a cuda target, a runtime without a compiler on
CPU that loads the kernels the build stage prebuilt, tini as PID 1, NIXL in the CUDA image."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from baton.engine.ops import cpu_paged_attention

ROOT = Path(__file__).resolve().parents[1]


def _stages() -> dict[str, str]:
    """Each stage's name and its instructions (continuation lines joined)."""
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n(\s*#.*\n)*", " ", text)  # join continued lines, dropping comments
    stages: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.I)
        if m:
            name = m.group(2) or m.group(1)
            stages[name] = line + "\n"
        elif name and line.strip() and not line.lstrip().startswith("#"):
            stages[name] += line + "\n"
    return stages


def _chain(stages: dict[str, str], name: str) -> str:
    """A stage's instructions with those of the stages it is built on."""
    base = stages[name].split()[1]
    return (_chain(stages, base) if base in stages else "") + stages[name]


def test_cpu_is_the_default_target_and_cuda_exists() -> None:
    stages = _stages()
    assert list(stages)[-1] == "cpu" and "cuda" in stages


def test_the_cpu_runtime_has_no_compiler_and_loads_prebuilt_kernels() -> None:
    stages = _stages()
    cpu = _chain(stages, "cpu")
    assert not re.search(r"\b(gcc|clang|build-essential|cc)\b", cpu.split("COPY --from")[0])
    prebuild = re.search(
        r"-m baton\.engine\.ops\.cpu_paged_attention --prebuild (\S+)", stages["build-cpu"]
    )
    assert prebuild, "the CPU build stage prebuilds the attention kernel"
    assert f"{cpu_paged_attention.KERNEL_DIR_ENV}={prebuild.group(1)}" in cpu
    assert "COPY --from=build-cpu" in cpu


def test_tini_is_pid_1_in_both_images() -> None:
    stages = _stages()
    for target in ("cpu", "cuda"):
        chain = _chain(stages, target)
        assert re.search(r'ENTRYPOINT \["tini", "--", "baton"\]', chain), target
        assert re.search(r"apt-get install .*\btini\b", chain), target
        assert "USER 10001" in stages[target]  # non-root, as the operator's pods require


def test_the_cuda_image_has_nixl_and_the_cpu_image_pins_torch() -> None:
    stages = _stages()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert "nixl" in extras and 'pip install ".[tracing,nixl]"' in stages["build-cuda"]
    assert "COPY --from=build-cuda" in stages["cuda"]
    pin = re.search(r"torch==[\d.]+", (ROOT / "Makefile").read_text())
    assert pin and f"TORCH_SPEC={pin.group(0)}" in stages["build-cpu"]
