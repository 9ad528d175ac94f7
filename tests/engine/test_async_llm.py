"""AsyncLLM against a real EngineCore process: handshake, streams, aborts, the core's death."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from baton import LLM, SamplingParams
from baton.engine import protocol as p
from baton.engine.async_llm import AsyncLLM, EngineDeadError
from baton.engine.config import EngineArgs
from baton.kv_transfer.base import TransferResult
from baton.kv_transfer.params import KVTransferParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


async def _collect(llm: AsyncLLM, request_id: str, ids: list[int], params=GREEDY) -> list:
    outs = [out async for out in llm.generate(request_id, ids, params)]
    return outs


def test_streams_equal_offline_llm_and_abort_frees_blocks(tiny_model) -> None:
    """Concurrent streams through the core process give the offline LLM's tokens; snapshots
    grow monotonically; an abandoned stream is aborted and its blocks freed; a utility call
    answers."""
    model = str(tiny_model("llama"))
    prompts = [[5, 6, 7 + i] * (i + 1) for i in range(6)]
    offline = LLM(model, max_model_len=256).generate(
        [{"prompt_token_ids": ids} for ids in prompts], GREEDY
    )

    async def main() -> None:
        llm = await AsyncLLM.start(EngineArgs(model=model, max_model_len=256))
        try:
            assert llm.num_blocks > 0 and llm.max_model_len == 256
            results = await asyncio.gather(
                *[_collect(llm, f"r{i}", ids) for i, ids in enumerate(prompts)]
            )
            for outs, ref in zip(results, offline, strict=True):
                assert outs[-1].finished and not any(o.finished for o in outs[:-1])
                assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
                assert outs[-1].outputs[0].text == ref.outputs[0].text
            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            async for out in llm.generate("abandoned", [5, 6, 7], long):
                if len(out.outputs[0].token_ids) >= 3:
                    break
            deadline = time.monotonic() + 5
            while llm.stats.kv_cache_usage > 0 or llm.stats.num_running:
                assert time.monotonic() < deadline, llm.stats
                await asyncio.sleep(0.05)
            assert await llm.reset_prefix_cache() is True
        finally:
            await llm.shutdown()
        assert llm.proc.poll() is not None

    asyncio.run(main())


def test_bad_input_is_rejected_before_queueing(tiny_model) -> None:
    """Empty, too long and out-of-vocabulary prompts and duplicate ids raise ValueError."""

    async def main() -> None:
        llm = await AsyncLLM.start(EngineArgs(model=str(tiny_model("llama")), max_model_len=32))
        try:
            for ids, message in [
                ([], "empty"),
                ([5] * 33, "max_model_len 32"),
                ([9999], "outside"),
            ]:
                with pytest.raises(ValueError, match=message):
                    await _collect(llm, "bad", ids)
            agen = llm.generate("dup", [5, 6], GREEDY)
            first = await agen.__anext__()
            assert first.request_id == "dup"
            with pytest.raises(ValueError, match="already in use"):
                await _collect(llm, "dup", [5, 6])
            await agen.aclose()
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_core_death_fails_every_stream_at_once(tiny_model) -> None:
    """Killing the EngineCore process ends every open stream with EngineDeadError within a
    second, and new requests are refused."""

    async def main() -> None:
        llm = await AsyncLLM.start(EngineArgs(model=str(tiny_model("llama")), max_model_len=2048))
        try:
            params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
            tasks = [
                asyncio.create_task(_collect(llm, f"k{i}", [5, 6, i + 7], params)) for i in range(4)
            ]
            await asyncio.sleep(0.3)
            os.kill(llm.engine_pid, signal.SIGKILL)
            start = time.monotonic()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert time.monotonic() - start < 1.0
            assert all(isinstance(r, EngineDeadError) for r in results), results
            with pytest.raises(EngineDeadError):
                await _collect(llm, "late", [5, 6])
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_a_model_that_cannot_load_fails_start_clearly(tmp_path: Path, tiny_model) -> None:
    """A core that cannot load its model reports why through the handshake; start() raises."""
    import json
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model("llama"), broken)
    config = json.loads((broken / "config.json").read_text())
    config["hidden_size"] = 48  # weights no longer fit
    (broken / "config.json").write_text(json.dumps(config))

    async def main() -> None:
        with pytest.raises(ValueError, match=r"the engine failed to start.*shape"):
            await AsyncLLM.start(EngineArgs(model=str(broken), max_model_len=64))

    asyncio.run(main())


def test_wire_messages_round_trip() -> None:
    """Requests and outputs survive the msgspec codec, typed hand-off params included; a value
    the engine would refuse does not decode."""
    kv = KVTransferParams(do_remote_decode=True, load_failure_policy="fail")
    msg = p.EngineCoreRequest("a", [1, 2, 70000], SamplingParams(stop=["x"]), 1.5, 0, None, kv)
    back = p.input_decoder.decode(p.encoder.encode(msg))
    assert back == msg and back.prompt_token_ids == [1, 2, 70000]
    assert isinstance(back.kv_transfer_params, KVTransferParams)
    out = p.EngineCoreOutputs(
        [p.EngineCoreOutput("a", [7], finish_reason="length", kv_transfer_params=kv)],
        p.EngineStats(kv_transfers=[TransferResult("a", False, "DEADLINE: late", 4, 0.5)]),
    )
    again = p.output_decoder.decode(p.encoder.encode(out))
    assert again == out and again.stats.kv_transfers[0].reason == "DEADLINE"
    with pytest.raises(Exception, match="temperature"):
        bad = p.EngineCoreRequest("a", [1], SamplingParams(), 1.0)
        raw = p.encoder.encode(bad).replace(b"temperature\xcb?\xf0", b"temperature\xcb\xbf\xf0")
        p.input_decoder.decode(raw)
