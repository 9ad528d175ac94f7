"""bench/throughput.py's profile breakdown and alternated rounds, bench/matmul.py's
packed-against-dense table and bench/cpu_attention.py's kernel against a revision, run as a user
runs them (subprocesses)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from baton.engine.layers.cpu_linear import packs
from baton.engine.ops import cpu_paged_attention as cpa

ROOT = Path(__file__).resolve().parents[2]


def test_the_torch_profile_accounts_for_the_whole_run(tiny_model) -> None:
    argv = [sys.executable, str(ROOT / "bench" / "throughput.py"), "--model", str(tiny_model()),
            "--num-requests", "6", "--skip-hf", "--torch-profile"]  # fmt: skip
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=300).stdout
    shares = dict(re.findall(r"^  (\S.*?)\s+([\d.]+)%", out, re.MULTILINE))
    assert set(shares) == {
        "GEMM (linear layers)",
        "attention (SDPA prefill, C decode)",
        "sampling",
        "other torch ops",
        "Python and the rest",
    }
    assert float(shares["GEMM (linear layers)"]) > 0 and float(shares["sampling"]) > 0
    assert 95 <= sum(map(float, shares.values())) <= 101  # the parts make the wall time
    assert re.search(r"^baton\s+[\d.]+ output tok/s", out, re.MULTILINE)


def test_rounds_alternate_the_engines_and_print_the_median_ratio(tiny_model, tmp_path) -> None:
    """`--rounds 3`: Baton, then the other engine, three times over; the ratio printed is the
    median of the rounds' own. The other side here is a stand-in interpreter that answers as
    bench/vllm_offline.py does (one JSON line) and counts its calls: vLLM is not installed."""
    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho x >> {calls}\necho '{{\"vllm_tok_s\": 50.0}}'\n")
    fake.chmod(0o755)
    out_json = tmp_path / "out.json"
    argv = [sys.executable, str(ROOT / "bench" / "throughput.py"), "--model", str(tiny_model()),
            "--num-requests", "4", "--skip-hf", "--vllm-python", str(fake), "--rounds", "3",
            "--json", str(out_json)]  # fmt: skip
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=300).stdout
    assert calls.read_text().count("x") == 3
    rounds = re.findall(r"^round (\d): baton_tok_s ([\d.]+), vllm_tok_s 50.00, ", out, re.M)
    assert [r for r, _ in rounds] == ["1", "2", "3"]
    ratios = sorted(float(tok_s) / 50.0 for _, tok_s in rounds)
    median = re.search(r"^ratio\s+([\d.]+)x baton / vllm \(same run: median of 3", out, re.M)
    assert median and float(median.group(1)) == pytest.approx(ratios[1], abs=0.01)
    result = json.loads(out_json.read_text())
    assert len(result["rounds"]) == 3 and result["vllm_tok_s"] == 50.0


@pytest.mark.skipif(not packs(torch.float32), reason="no oneDNN packed linear here")
def test_matmul_prints_packed_against_dense_for_every_shape() -> None:
    argv = [sys.executable, str(ROOT / "bench" / "matmul.py"), "--batch", "1", "--threads", "1"]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=300).stdout
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+1\s+\d+\s+\d+", line)]
    assert len(rows) == 5  # SmolLM2's five projection shapes
    for row in rows:
        assert float(row[3]) > 0 and float(row[4]) > 0 and row[5].endswith("x")


@pytest.mark.skipif(
    not cpa.available(torch.float32, 8, 4, 32, 16), reason="no C compiler for the CPU kernel"
)
def test_cpu_attention_prints_every_shape_against_a_revision() -> None:
    """bench/cpu_attention.py times this tree's kernel and a git revision's side by side."""
    argv = [sys.executable, str(ROOT / "bench" / "cpu_attention.py"), "--against", "HEAD",
            "--batch", "4", "--context", "20", "40", "--repeats", "1"]  # fmt: skip
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=300).stdout
    rows = re.findall(
        r"^(small|smollm2)\s+(float32|bfloat16)\s.* HEAD: [\d.]+ ms, x[\d.]+$", out, re.M
    )
    assert sorted(rows) == sorted(
        (m, d) for m in ("small", "smollm2") for d in ("float32", "bfloat16")
    )
