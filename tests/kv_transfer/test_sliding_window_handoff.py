"""Disaggregated prefill/decode of a sliding-window model (Mistral, an 8-token window): the same
greedy tokens as one engine alone, whose requests give blocks behind the window back, while
handed-off requests keep every block their transfer moves."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kv_transfer.test_connector_core import (
    GREEDY,
    _drain,
    _engine,
    _hand_off,
    _prompts,
    _request,
    _run,
    transfers,
)


@pytest.fixture(scope="module")
def model(tiny_model) -> Path:
    return tiny_model("mistral", sliding_window=8)


def test_disaggregated_windowed_model_equals_single_engine(model: Path) -> None:
    """Prompts up to four windows long, handed off over TCP, decode to the single engine's
    tokens; the prefill engine frees every block once the leases are claimed."""
    single = _engine(model, None)
    assert single.scheduler.kv.sliding_window == 8
    prompts = [*_prompts(), [3 + (5 * j) % 300 for j in range(33)]]
    want = _run(single, [_request(f"s{i}", ids, GREEDY) for i, ids in enumerate(prompts)])
    prefill = _engine(model, "prefill", transport="tcp")
    decode = _engine(model, "decode", transport="tcp")
    try:
        pre, got = _hand_off(prefill, decode, prompts)
        for i in range(len(prompts)):
            assert got[f"d{i}"].new_token_ids == want[f"s{i}"].new_token_ids, i
            assert pre[f"p{i}"].new_token_ids == want[f"s{i}"].new_token_ids[:1]
        _drain(prefill)
        assert prefill.scheduler.kv.usage() == 0.0
        assert [r.ok for r in transfers(decode)].count(True) == sum(len(p) > 1 for p in prompts)
    finally:
        prefill.shutdown()
        decode.shutdown()
