"""Tests for the Triton grouped-GEMM MoE kernel against its torch reference (CPU interpreter and
CUDA), the expert alignment it relies on, and its checks."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from baton.engine.models.moe import fused_experts, select_experts
from baton.engine.ops.fused_moe import (
    _grouped_gemm_kernel,
    align_pairs,
    fused_moe,
    fused_moe_reference,
)


def _inputs(
    device: torch.device,
    num_tokens: int,
    num_experts: int,
    top_k: int,
    hidden: int = 64,
    inter: int = 48,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, ...]:
    x = torch.randn(num_tokens, hidden)
    gate_up = torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter) / inter**0.5
    weights, ids = select_experts(torch.randn(num_tokens, num_experts), top_k, renormalize=True)
    return (
        x.to(device, dtype),
        gate_up.to(device, dtype),
        down.to(device, dtype),
        weights.to(device),
        ids.to(device),
    )


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k"),
    [
        (1, 4, 2),  # one decode: most experts idle
        (5, 16, 4),  # more experts than pairs
        (37, 8, 2),  # runs not a multiple of BLOCK_M
        (200, 4, 1),  # prefill-sized: BLOCK_M 64, several blocks per expert
    ],
)
def test_matches_reference(device: torch.device, num_tokens: int, num_experts: int, top_k: int):
    """fp32 outputs equal the gathered-weights reference, and on CUDA the model's MoE path
    (which launches the kernel there) equals the CPU grouped path."""
    args = _inputs(device, num_tokens, num_experts, top_k)
    expected = fused_moe_reference(*args)
    torch.testing.assert_close(fused_moe(*args), expected, atol=2e-5, rtol=2e-5)
    if device.type == "cuda":
        on_cpu = fused_experts(*(t.cpu() for t in args))
        torch.testing.assert_close(fused_experts(*args).cpu(), on_cpu, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(device: torch.device, dtype: torch.dtype) -> None:
    """fp16/bf16 inputs give a same-dtype output close to the fp32 reference."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("tl.dot on bf16 is wrong in Triton's CPU interpreter")
    args = _inputs(device, 24, 8, 2, dtype=dtype)
    out = fused_moe(*args)
    assert out.dtype == dtype
    expected = fused_moe_reference(*(t.float() if t.is_floating_point() else t for t in args))
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(("num_tokens", "block_m"), [(1, 16), (37, 16), (300, 64)])
def test_align_pairs_groups_every_pair_once(num_tokens: int, block_m: int) -> None:
    """Every pair appears once, each BLOCK_M rows hold one expert's pairs (or padding), and the
    used length is a multiple of BLOCK_M within the worst-case size."""
    num_experts, top_k = 8, 2
    ids = torch.randint(0, num_experts, (num_tokens, top_k))
    aligned = align_pairs(ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    used = int(aligned.num_sorted)
    assert used % block_m == 0 and used <= aligned.sorted_pairs.numel()
    rows = aligned.sorted_pairs[:used].long()
    assert sorted(rows[rows < num_pairs].tolist()) == list(range(num_pairs))
    assert (aligned.sorted_pairs[used:] == num_pairs).all()
    flat = ids.reshape(-1)
    for block in range(used // block_m):
        pairs = rows[block * block_m : (block + 1) * block_m]
        pairs = pairs[pairs < num_pairs]
        assert len(pairs) > 0  # no block is all padding
        assert (flat[pairs] == int(aligned.block_expert[block])).all()


def test_empty_batch(device: torch.device) -> None:
    """No tokens: nothing launches, an empty [0, hidden] comes back."""
    x, gate_up, down, weights, ids = _inputs(device, 0, 4, 2)
    assert fused_moe(x, gate_up, down, weights, ids).shape == (0, 64)


def test_compiles_for_hopper(compile_for_hopper: Callable[[list[dict[str, Any]]], None]) -> None:
    """Both GEMMs' variants (with and without routing weights, decode and prefill tiles, each
    dtype) compile for sm_90, not just interpret."""
    jobs = []
    for dtype, mul_weight, block_m, block_k in [
        ("fp16", False, 16, 64),
        ("bf16", True, 64, 32),
        ("fp32", True, 16, 64),
    ]:
        jobs.append(
            {
                "module": _grouped_gemm_kernel.__module__,
                "kernel": _grouped_gemm_kernel.__name__,
                "pointers": {"a_ptr": dtype, "b_ptr": dtype, "c_ptr": dtype}
                | {"weights_ptr": "fp32", "sorted_pairs_ptr": "i32"}
                | {"block_expert_ptr": "i32", "num_sorted_ptr": "i32"},
                "constexprs": {
                    "TOP_K": 1 if mul_weight else 2,
                    "MUL_WEIGHT": mul_weight,
                    "BLOCK_M": block_m,
                    "BLOCK_N": 64,
                    "BLOCK_K": block_k,
                    "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
                },
                "num_warps": 4,
            }
        )
    compile_for_hopper(jobs)


def _valid_args() -> dict[str, torch.Tensor]:
    return {
        "x": torch.zeros(3, 8),
        "gate_up_proj": torch.zeros(4, 12, 8),
        "down_proj": torch.zeros(4, 8, 6),
        "topk_weights": torch.ones(3, 2),
        "topk_ids": torch.zeros(3, 2, dtype=torch.long),
    }


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"x": torch.zeros(3, 7)}, "do not agree"),
        ({"down_proj": torch.zeros(4, 8, 5)}, "do not agree"),
        ({"gate_up_proj": torch.zeros(12, 8)}, "need x"),
        ({"topk_ids": torch.zeros(2, 2, dtype=torch.long)}, "num_tokens=3"),
        ({"x": torch.zeros(3, 8, dtype=torch.float16)}, "share one dtype"),
        ({"down_proj": torch.zeros(4, 6, 8).transpose(1, 2)}, "contiguous in its last dim"),
    ],
)
def test_rejects_bad_inputs(change: dict[str, torch.Tensor], match: str) -> None:
    """Inconsistent shapes, dtypes and strides raise ValueError naming the problem."""
    args = _valid_args() | change
    for fn in (fused_moe, fused_moe_reference):
        with pytest.raises(ValueError, match=match):
            fn(**args)


def test_works_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without triton the module imports, the reference runs, and launching says what is missing."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.find_spec("baton.engine.ops.fused_moe")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.fused_moe_reference(**_valid_args())
    with pytest.raises(RuntimeError, match="needs triton"):
        module.fused_moe(**_valid_args())
