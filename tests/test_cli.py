"""The `baton` command line: tiny-model, demo, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from baton.cli import main


def test_tiny_model_command_writes_a_model(tmp_path: Path) -> None:
    """`baton tiny-model PATH --arch qwen3` writes config, weights and tokenizer files."""
    main(["tiny-model", str(tmp_path / "m"), "--arch", "qwen3", "--size", "tiny"])
    files = {p.name for p in (tmp_path / "m").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]


def test_demo_runs_as_a_console_script(tiny_model) -> None:
    """`baton demo --model PATH` runs offline generation in a fresh process and prints it."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "baton.cli",
            "demo",
            "--model",
            str(tiny_model("llama")),
            "--max-model-len",
            "128",
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "12 tokens in" in result.stdout


def test_bad_arguments_exit_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A missing model folder ends with exit code 2 and a one-line error, not a traceback."""
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--model", str(tmp_path / "missing")])
    assert exc.value.code == 2
    assert "does not exist" in capsys.readouterr().err
