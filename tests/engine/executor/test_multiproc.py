"""Tests of the multiprocess executor: its workers' lifecycle, and a worker that dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from baton import LLM, SamplingParams
from baton.engine.config import EngineArgs
from baton.engine.executor import WorkerDiedError
from baton.engine.executor.messages import WorkerFailed
from baton.engine.executor.multiproc import MultiprocExecutor
from baton.kv_transfer.base import KVTransferConfig
from tests.support.procs import alive

_LONG = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)


def _workers(llm: LLM) -> list[int]:
    executor = llm.engine.executor
    assert isinstance(executor, MultiprocExecutor)
    return executor.worker_pids


def test_uni_executor_refuses_tensor_parallelism() -> None:
    """Engine args that cannot work with tensor parallelism fail with a clear ValueError; a
    KV connector works with any tensor_parallel_size and either executor."""
    EngineArgs(tensor_parallel_size=2, kv_transfer=KVTransferConfig(role="prefill"))
    EngineArgs(distributed_executor_backend="mp", kv_transfer=KVTransferConfig(role="decode"))
    with pytest.raises(ValueError, match="needs 'mp'"):
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineArgs(tensor_parallel_size=0)


def test_a_model_that_does_not_split_fails_before_any_worker_starts(tiny_model) -> None:
    """tensor_parallel_size 3 over 4 heads is refused at once, naming the heads."""
    started = time.monotonic()
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        LLM(str(tiny_model("llama")), max_model_len=256, tensor_parallel_size=3)
    assert time.monotonic() - started < 2  # no worker process was spawned


@pytest.mark.slow
def test_mp_executor_with_one_rank_matches_in_process(tiny_model) -> None:
    """tensor_parallel_size 1 through a worker process gives the in-process tokens, and
    shutdown() leaves no worker behind."""
    path = str(tiny_model("llama"))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (4, 30)]
    expected = [
        o.outputs[0].token_ids for o in LLM(path, max_model_len=256).generate(prompts, params)
    ]
    llm = LLM(path, max_model_len=256, distributed_executor_backend="mp")
    (pid,) = _workers(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.shutdown()
    assert got == expected
    assert not alive(pid)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_killed_worker_fails_the_running_step_within_seconds(tiny_model, rank: int) -> None:
    """SIGKILL to one rank mid-generation makes the step raise WorkerDiedError naming it within
    seconds, and the other rank is stopped too."""
    llm = LLM(str(tiny_model("llama")), max_model_len=2048, tensor_parallel_size=2)
    pids = _workers(llm)
    killed_at: list[float] = []

    def kill() -> None:
        os.kill(pids[rank], signal.SIGKILL)
        killed_at.append(time.monotonic())

    timer = threading.Timer(0.5, kill)
    timer.start()
    try:
        with pytest.raises(WorkerDiedError, match=f"rank {rank} .*exited with code -9"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], _LONG)
        assert time.monotonic() - killed_at[0] < 3
    finally:
        timer.cancel()
        llm.shutdown()
    assert not any(alive(p) for p in pids)


def test_a_failure_report_names_the_killed_peer_behind_it() -> None:
    """When rank 1 is killed, rank 0's all-reduce breaks and rank 0 may report its own failure
    before rank 1's exit is seen (a race a CI run hit): the error names the killed rank as the
    cause. A rank that fails on its own, with its peers alive, is named itself."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in "01"]
    stub = type("Stub", (), {})()
    stub._workers = type("Workers", (), {"procs": procs})()
    report = WorkerFailed(0, "RuntimeError: Connection reset by peer")
    try:
        alone = MultiprocExecutor._failed(stub, report)  # type: ignore[arg-type]
        assert str(alone).startswith("tensor-parallel worker rank 0 failed: RuntimeError")
        procs[1].kill()
        caused = MultiprocExecutor._failed(stub, report)  # type: ignore[arg-type]
        assert "rank 1" in str(caused) and "exited with code -9" in str(caused)
        assert "rank 0 then failed: RuntimeError" in str(caused)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_idle_engine_notices_a_dead_worker(tiny_model) -> None:
    """With nothing to run, check_health() raises once a worker is gone."""
    llm = LLM(str(tiny_model("llama")), max_model_len=256, tensor_parallel_size=2)
    try:
        llm.engine.check_health()
        os.kill(_workers(llm)[1], signal.SIGKILL)
        deadline = time.monotonic() + 2
        with pytest.raises(WorkerDiedError, match="rank 1"):
            while time.monotonic() < deadline:
                llm.engine.check_health()
                time.sleep(0.01)
    finally:
        llm.shutdown()
