"""bench/handoff.py against real engines: the hand-off and its no-pull floor compute the same
prompt tokens (the engine's own count says so), every pull succeeds, and the printed cost is the
JSON's. A floor that computed a whole block more than the hand-off once made the hand-off look
up to 5 ms cheaper than it was."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.long


def _run(tmp_path: Path, *args: str) -> tuple[str, dict]:
    out = tmp_path / "handoff.json"
    proc = subprocess.run(
        [sys.executable, "bench/handoff.py", "--repeats", "2", "--json", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_both_sides_compute_one_token_and_every_pull_lands(tmp_path: Path) -> None:
    stdout, result = _run(tmp_path, "--warm-cache")
    assert result["prompt_tokens"] == 2001
    assert result["computed_prompt_tokens"] == [1.0]
    assert result["pull_failures"] == 0
    assert len(result["decode_server_ttft_seconds"]) == len(result["raw_transfer_seconds"]) == 2
    # The pull moves 125 whole blocks: all but the last of the 2,001 prompt tokens.
    assert result["kv_bytes"] % 125 == 0
    assert f"{result['handoff_cost_over_raw_transfer']:.2f}x the raw transfer" in stdout
    assert "WARNING" not in stdout


def test_a_prompt_of_whole_blocks_is_flagged(tmp_path: Path) -> None:
    """At 2,000 tokens the cached floor recomputes its last block (16 tokens), the hand-off one."""
    stdout, result = _run(tmp_path, "--prompt-len", "2000")
    assert result["computed_prompt_tokens"] == [1.0, 16.0]
    assert "WARNING: the two sides computed [1.0, 16.0] prompt tokens" in stdout
