"""Every script in bench/ imports: a script that takes a name from another one that no longer
has it fails here rather than when someone runs it (bench/metrics_overhead.py and
bench/prefix_routing.py both did, after bench/router.py and bench/disagg.py changed)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_script_imports(name: str) -> None:
    module = importlib.import_module(f"bench.{name}")
    if 'if __name__ == "__main__":' in (BENCH / f"{name}.py").read_text():
        assert callable(getattr(module, "main", None)), f"bench/{name}.py runs no main()"
