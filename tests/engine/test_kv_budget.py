"""--gpu-memory-utilization as vLLM means it: a per-engine share of the whole GPU, so that two
engines at 0.45 fit on one GPU whichever starts first (the budget arithmetic; the GPU run is in
scripts/gpu_check.sh)."""

from __future__ import annotations

from baton.engine.core import kv_budget

GIB = 1 << 30


def test_one_engine_takes_its_share_less_its_weights() -> None:
    # 80 GiB GPU, 2 GiB of weights held, 77.5 GiB free (context and others: 0.5 GiB)
    assert kv_budget(int(77.5 * GIB), 80 * GIB, 2 * GIB, 0.9) == 70 * GIB


def test_two_engines_at_045_both_fit_whichever_starts_first() -> None:
    total, weights = 80 * GIB, 2 * GIB
    first = kv_budget(total - weights - GIB // 2, total, weights, 0.45)
    used_by_first = weights + first + GIB // 2
    second = kv_budget(total - used_by_first - weights - GIB // 2, total, weights, 0.45)
    assert first == second == 34 * GIB
    assert used_by_first * 2 < total  # headroom for activations is left over


def test_never_more_than_is_free_and_never_negative() -> None:
    assert kv_budget(5 * GIB, 80 * GIB, 2 * GIB, 0.9) == 5 * GIB  # another tenant took the rest
    assert kv_budget(60 * GIB, 80 * GIB, 10 * GIB, 0.1) == 0  # weights exceed the share
