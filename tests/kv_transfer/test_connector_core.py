"""Two EngineCores in one process, a prefill and a decode engine, hand a prompt's KV over TCP and
over NIXL: the decode engine's greedy tokens equal a single engine's, and every lease and pull
ends."""

from __future__ import annotations

import importlib
import os
import signal
import threading
import time
import weakref
from pathlib import Path

import msgspec
import pytest

from baton.engine.config import EngineArgs
from baton.engine.core import EngineCore
from baton.engine.executor import WorkerDiedError
from baton.engine.executor.multiproc import MultiprocExecutor
from baton.engine.protocol import EngineCoreOutput, EngineCoreRequest
from baton.engine.request import RequestStatus
from baton.engine.sampling_params import SamplingParams
from baton.kv_transfer.base import KVTransferConfig, TransferResult
from baton.kv_transfer.keyring import prompt_hash
from baton.kv_transfer.params import KVTransferParams

BLOCK = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _engine(model: Path, role: str | None, tp: int = 1, **kv: object) -> EngineCore:
    kvt = KVTransferConfig(role=role, **kv) if role else None  # type: ignore[arg-type]
    args = EngineArgs(
        model=str(model),
        max_model_len=256,
        block_size=BLOCK,
        num_gpu_blocks_override=128,
        kv_transfer=kvt,
        tensor_parallel_size=tp,
    )
    return EngineCore(args)


def _request(
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    kv_transfer_params: dict | KVTransferParams | None = None,
) -> EngineCoreRequest:
    """An engine request, with its kv_transfer_params parsed as the API server parses them."""
    if isinstance(kv_transfer_params, dict):
        kv_transfer_params = KVTransferParams.parse(kv_transfer_params)
    return EngineCoreRequest(request_id, prompt, params, time.time(), 0, None, kv_transfer_params)


# Pulls that ended on each engine, as its stats reported them.
_TRANSFERS: weakref.WeakKeyDictionary[EngineCore, list[TransferResult]] = (
    weakref.WeakKeyDictionary()
)


def _step(core: EngineCore) -> list[EngineCoreOutput]:
    step = core.step()
    if step is None:
        return []
    _TRANSFERS.setdefault(core, []).extend(step.stats.kv_transfers)
    return step.outputs


def transfers(core: EngineCore) -> list[TransferResult]:
    return _TRANSFERS.get(core, [])


def _run(
    core: EngineCore, requests: list[EngineCoreRequest], timeout: float = 30
) -> dict[str, EngineCoreOutput]:
    """Steps until every request finished; returns each one's last output (with all tokens)."""
    for r in requests:
        core.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    last: dict[str, EngineCoreOutput] = {}
    deadline = time.monotonic() + timeout
    while len(last) < len(requests):
        assert time.monotonic() < deadline, f"not finished: {set(tokens) - set(last)}"
        if not core.has_unfinished_requests():
            time.sleep(0.001)
        for out in _step(core):
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                out.new_token_ids = tokens[out.request_id]
                last[out.request_id] = out
    return last


def _drain(core: EngineCore, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while core.has_pending_transfers() or core.has_unfinished_requests():
        assert time.monotonic() < deadline, "transfers still pending"
        _step(core)
        time.sleep(0.001)


def _params(out: EngineCoreOutput) -> dict:
    """A prefill answer's kv_transfer_params as the client sees them (JSON)."""
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params.to_json()


def _prompts() -> list[list[int]]:
    # shorter than a block, exactly one block, several blocks, block-aligned, long
    return [[5 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate((1, 3, 4, 9, 16, 37))]


@pytest.fixture(scope="module")
def model(tiny_model) -> Path:
    return tiny_model("llama")


@pytest.fixture(params=["tcp", "nixl"])
def transport(request: pytest.FixtureRequest) -> str:
    """The KV transport of the disaggregated engines; nixl runs where a NIXL package imports."""
    if request.param == "nixl":
        try:
            importlib.import_module("baton.kv_transfer.nixl.transport")
        except ImportError as exc:
            pytest.skip(f"NIXL is not available: {exc}")
    return str(request.param)


def _prefill_request(request_id: str, prompt: list[int]) -> EngineCoreRequest:
    """The prefill step of a hand-off: one token, the prompt's blocks leased."""
    hand_off = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    return _request(request_id, prompt, hand_off, kv_transfer_params={"do_remote_decode": True})


def _hand_off(prefill: EngineCore, decode: EngineCore, prompts, decode_params=None):
    pre = _run(prefill, [_prefill_request(f"p{i}", ids) for i, ids in enumerate(prompts)])
    reqs = []
    for i, ids in enumerate(prompts):
        params = _params(pre[f"p{i}"])
        assert params["num_prompt_tokens"] == len(ids)
        params.update(decode_params or {})
        reqs.append(_request(f"d{i}", ids, GREEDY, kv_transfer_params=params))
    return pre, _run(decode, reqs)


def test_disaggregated_equals_single_engine(model: Path, transport: str) -> None:
    """Prefill on one engine, decode on another: the same greedy tokens as one engine alone; the
    prefill engine's leases are all claimed and its blocks freed."""
    single = _engine(model, None)
    prompts = _prompts()
    want = _run(single, [_request(f"s{i}", ids, GREEDY) for i, ids in enumerate(prompts)])
    prefill, decode = (
        _engine(model, "prefill", transport=transport),
        _engine(model, "decode", transport=transport),
    )
    try:
        assert decode.connector_worker is not None
        assert decode.connector_worker.transport_name == transport  # no silent TCP fallback
        pre, got = _hand_off(prefill, decode, prompts)
        for i in range(len(prompts)):
            assert got[f"d{i}"].new_token_ids == want[f"s{i}"].new_token_ids, i
            # The prefill engine's one token is the first decode token.
            assert pre[f"p{i}"].new_token_ids == want[f"s{i}"].new_token_ids[:1]
        _drain(prefill)
        assert not prefill.scheduler.remote_kv.leased
        assert prefill.scheduler.kv.usage() == 0.0
        results = transfers(decode)
        assert [r.ok for r in results].count(True) == sum(len(p) > 1 for p in prompts)
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_pull_starts_before_the_batch_it_waits_beside_computes(
    model: Path, async_scheduling: bool
) -> None:
    """A step that schedules a hand-off's pull hands it to the connector before it runs the
    model for the rest of the batch, so the pull overlaps that compute (not the step after);
    the request then finishes on the pulled KV."""
    prompt = _prompts()[-1]
    prefill = _engine(model, "prefill")
    kvt = KVTransferConfig(role="decode")
    decode = EngineCore(
        EngineArgs(
            model=str(model), max_model_len=256, block_size=BLOCK, num_gpu_blocks_override=128,
            kv_transfer=kvt, async_scheduling=async_scheduling,
        )
    )  # fmt: skip
    try:
        params = _params(_run(prefill, [_prefill_request("p", prompt)])["p"])
        busy = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        decode.add_request(_request("busy", [7, 8, 9], busy))
        for _ in range(3):
            _step(decode)  # "busy" is running: every step computes
        calls: list[str] = []
        worker, executor = decode.connector_worker, decode.executor
        assert worker is not None
        start_load, run_model = worker.start_load_kv, executor.execute_model_async

        def start_load_kv(meta):  # type: ignore[no-untyped-def]
            calls.extend("pull" for _ in meta.loads)
            start_load(meta)

        def execute_model_async(out):  # type: ignore[no-untyped-def]
            calls.append("model")
            return run_model(out)

        worker.start_load_kv = start_load_kv  # type: ignore[method-assign]
        executor.execute_model_async = execute_model_async  # type: ignore[method-assign]
        decode.add_request(_request("d", prompt, GREEDY, kv_transfer_params=params))
        _step(decode)
        assert calls[:2] == ["pull", "model"], calls
        got: dict[str, EngineCoreOutput] = {}
        deadline = time.monotonic() + 30
        tokens: list[int] = []
        while not got.get("d"):
            assert time.monotonic() < deadline, "the hand-off did not finish"
            for out in _step(decode):
                if out.request_id == "d":
                    tokens += out.new_token_ids
                    if out.finished:
                        got["d"] = out
            time.sleep(0.001)
        assert len(tokens) == GREEDY.max_tokens
        assert [r.ok for r in transfers(decode) if r.req_id == "d"] == [True]
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_pull_that_ended_between_steps_resumes_and_computes_in_one_step(model: Path) -> None:
    """The first step after a pull ended both resumes its request and computes the request's
    first token: resuming takes no step of its own (a whole turn of an idle engine's loop)."""
    prompt = _prompts()[-1]
    prefill, decode = _engine(model, "prefill"), _engine(model, "decode")
    try:
        params = _params(_run(prefill, [_prefill_request("p", prompt)])["p"])
        worker = decode.connector_worker
        assert worker is not None and worker.transport is not None
        gate, read = threading.Event(), worker.transport.read

        def gated_read(spec, deadline):  # type: ignore[no-untyped-def]
            gate.wait(10)  # the pull ends only once the step that started it is over
            return read(spec, deadline)

        worker.transport.read = gated_read  # type: ignore[method-assign]
        decode.add_request(_request("d", prompt, GREEDY, kv_transfer_params=params))
        assert _step(decode) == []  # schedules the pull; nothing to compute yet
        gate.set()
        deadline = time.monotonic() + 10
        while not worker._done:  # the loader thread reported the pull
            assert time.monotonic() < deadline, "the pull did not end"
            time.sleep(0.001)
        first = [o for o in _step(decode) if o.request_id == "d"]
        assert len(first) == 1 and len(first[0].new_token_ids) == 1
        assert [r.ok for r in transfers(decode)] == [True]
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_decode_request_hashes_its_prompt_once(model: Path, monkeypatch) -> None:
    """The params' check hashes the whole prompt; the scheduler asks for it twice per request
    (matched tokens, then after allocating), so the second answer is the first one kept."""
    from baton.kv_transfer import connector

    hashed: list[int] = []

    def counting(token_ids):  # type: ignore[no-untyped-def]
        hashed.append(len(token_ids))
        return prompt_hash(token_ids)

    monkeypatch.setattr(connector, "prompt_hash", counting)
    prefill, decode = _engine(model, "prefill"), _engine(model, "decode")
    try:
        prompts = _prompts()
        _, got = _hand_off(prefill, decode, prompts)
        assert len(got) == len(prompts)
        assert sorted(hashed) == sorted(len(p) for p in prompts)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_decode_prefix_cache_hit_pulls_only_the_rest(model: Path, transport: str) -> None:
    """A prompt whose prefix the decode engine caches pulls only the blocks after it, and a prompt
    it caches entirely pulls nothing but releases the lease at once."""
    prefill, decode = (
        _engine(model, "prefill", transport=transport),
        _engine(model, "decode", transport=transport),
    )
    single = _engine(model, None)
    base = [9 + j % 50 for j in range(21)]
    prompts = [base, [*base, 3, 4, 5, 6, 7, 8, 9]]
    want = _run(single, [_request(f"s{i}", p, GREEDY) for i, p in enumerate(prompts)])
    try:
        _run(decode, [_request("warm", base, GREEDY)])  # the decode engine now caches `base`
        _, got = _hand_off(prefill, decode, prompts)
        assert got["d0"].new_token_ids == want["s0"].new_token_ids
        assert got["d1"].new_token_ids == want["s1"].new_token_ids
        pulled = [r for r in transfers(decode) if r.ok]
        assert len(pulled) == 1 and pulled[0].req_id == "d1"
        block_bytes = decode.runner.kv_bytes_per_block()
        # 28 tokens, 27 needed, 20 cached -> blocks 5 and 6 of 4 tokens
        assert pulled[0].num_bytes == 2 * block_bytes
        _drain(prefill)
        assert not prefill.scheduler.remote_kv.leased  # d0's lease was released, not left to expire
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_restarted_prefill_engine_follows_the_failure_policy(
    model: Path, policy: str, transport: str
) -> None:
    """Params naming an engine id that is not the one at that address (a restart) are never
    read: recompute gives the single-engine answer, fail ends the request with an error."""
    prefill, decode = (
        _engine(model, "prefill", transport=transport),
        _engine(model, "decode", transport=transport),
    )
    single = _engine(model, None)
    prompt = list(range(10, 40))
    want = _run(single, [_request("s", prompt, GREEDY)])["s"].new_token_ids
    try:
        pre = _run(prefill, [_prefill_request("p", prompt)])
        params = dict(
            _params(pre["p"]),
            remote_engine_id="someone-else",
            kv_load_failure_policy=policy,
        )
        got = _run(decode, [_request("d", prompt, GREEDY, kv_transfer_params=params)])["d"]
        if policy == "recompute":
            assert got.new_token_ids == want and got.finish_reason == "length"
        else:
            assert got.finish_reason == "error"
            assert "UNKNOWN_ENGINE" in (got.error or "")
        assert transfers(decode)[0].reason == "UNKNOWN_ENGINE"
        _drain(decode)
        assert decode.scheduler.kv.usage() == 0.0 or policy == "recompute"
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_unclaimed_lease_expires_and_frees_blocks(model: Path, transport: str) -> None:
    """Nobody pulls: the lease expires after its time and the prefill engine's blocks return."""
    prefill = _engine(model, "prefill", lease_seconds=0.3, transport=transport)
    try:
        _run(prefill, [_prefill_request("p", list(range(3, 30)))])
        assert prefill.scheduler.kv.usage() > 0
        assert prefill.scheduler.make_stats().kv_blocks_leased == 7
        _drain(prefill)
        stats = prefill.scheduler.make_stats()
        assert stats.kv_leases_expired == 1 and stats.kv_blocks_leased == 0
        assert prefill.scheduler.kv.usage() == 0.0
    finally:
        prefill.shutdown()


def test_nothing_listening_recomputes_within_the_timeout(model: Path, transport: str) -> None:
    """Params pointing at a port where nobody listens: the pull fails fast and the request is
    recomputed locally."""
    decode = _engine(model, "decode", load_timeout=2.0, transport=transport)
    single = _engine(model, None)
    prompt = list(range(50, 70))
    want = _run(single, [_request("s", prompt, GREEDY)])["s"].new_token_ids
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "x",
        "remote_host": "127.0.0.1",
        "remote_port": 9,
        "remote_request_id": "r",
        "remote_block_ids": list(range(5)),
        "num_prompt_tokens": len(prompt),
        "lease_expires_at": time.time() + 30,
        # What a prefill engine of the same model would have said (the core does not verify
        # signatures: its API server does).
        "fingerprint": msgspec.to_builtins(decode.fingerprint),
        "prompt_hash": prompt_hash(prompt),
    }
    try:
        start = time.monotonic()
        got = _run(decode, [_request("d", prompt, GREEDY, kv_transfer_params=params)])["d"]
        assert got.new_token_ids == want
        assert time.monotonic() - start < 5
        assert transfers(decode)[0].reason == "CONNECT_FAILED"
    finally:
        decode.shutdown()


def test_abort_while_pulling_frees_blocks_after_the_pull(model: Path, transport: str) -> None:
    """A request aborted in WAITING_FOR_REMOTE_KVS keeps its blocks until the loader is done
    with them, then frees them."""
    prefill, decode = (
        _engine(model, "prefill", transport=transport),
        _engine(model, "decode", transport=transport),
    )
    try:
        pre = _run(prefill, [_prefill_request("p", list(range(3, 40)))])
        # The pull waits at a gate, so that it is surely in flight when the abort comes (a local
        # pull may otherwise end within the step that starts it).
        transport = decode.connector_worker.transport  # the worker half: in process (uni)
        gate, read = threading.Event(), transport.read
        transport.read = lambda spec, deadline: gate.wait(10) and read(spec, deadline)
        decode.add_request(
            _request("d", list(range(3, 40)), GREEDY, kv_transfer_params=_params(pre["p"]))
        )
        _step(decode)
        parked = decode.scheduler.remote_kv.waiting_for_kvs["d"]
        assert parked.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        # it waits (vllm:num_requests_waiting shows it, as vLLM's does), it does not run
        stats = decode.scheduler.make_stats()
        assert (stats.num_waiting, stats.num_running) == (1, 0)
        decode.abort_requests(["d"])
        for _ in range(3):
            _step(decode)
        assert decode.scheduler.kv.usage() > 0.0  # the loader may still write into them
        gate.set()
        _drain(decode)
        assert decode.scheduler.kv.usage() == 0.0
        assert not decode.scheduler.requests
    finally:
        prefill.shutdown()
        decode.shutdown()


# Each transport and each KV-head layout once in make test; the two other pairings re-prove
# those same paths (the transport moves a rank's blocks whatever their layout) at four worker
# processes each, so they run in make test-long.
_TP2_CASES = [
    pytest.param("tcp", None, id="tcp-split-kv-heads"),
    pytest.param("nixl", 1, id="nixl-replicated-kv-head"),
    pytest.param("tcp", 1, id="tcp-replicated-kv-head", marks=pytest.mark.long),
    pytest.param("nixl", None, id="nixl-split-kv-heads", marks=pytest.mark.long),
]


@pytest.mark.slow  # four worker processes
@pytest.mark.parametrize(("transport", "kv_heads"), _TP2_CASES, indirect=["transport"])
def test_tp2_disaggregated_equals_single_engine(
    tiny_model, transport: str, kv_heads: int | None
) -> None:
    """Prefill and decode engines with tensor_parallel_size 2: each decode rank pulls its shard
    from the matching prefill rank, and the answers equal one tensor_parallel_size 1 engine's
    (with the KV heads split across the ranks, and with one KV head replicated on both)."""
    path = tiny_model("llama") if kv_heads is None else tiny_model("llama", num_key_value_heads=1)
    prompts = _prompts()
    single = _engine(path, None)
    want = _run(single, [_request(f"s{i}", ids, GREEDY) for i, ids in enumerate(prompts)])
    single.shutdown()
    prefill = _engine(path, "prefill", tp=2, transport=transport)
    try:
        decode = _engine(path, "decode", tp=2, transport=transport)
    except BaseException:
        prefill.shutdown()
        raise
    try:
        assert decode.connector_worker is not None
        assert decode.connector_worker.transport_name == transport
        ports = decode.connector_worker.ports
        assert len(ports) == 2 and ports[0] != ports[1]  # one server per rank
        pre, got = _hand_off(prefill, decode, prompts)
        for i in range(len(prompts)):
            assert got[f"d{i}"].new_token_ids == want[f"s{i}"].new_token_ids, i
            assert len(_params(pre[f"p{i}"])["remote_ports"]) == 2
        results = transfers(decode)
        assert all(r.ok for r in results), [r.error for r in results]
        assert len(results) == sum(len(p) > 1 for p in prompts)
        _drain(prefill)
        _drain(decode)
        assert not prefill.scheduler.remote_kv.leased  # claimed on both ranks
        assert prefill.scheduler.kv.usage() == 0.0
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.slow
def test_unequal_tensor_parallel_sizes_are_refused(model: Path) -> None:
    """A decode engine never reads shards laid out for another tensor_parallel_size: the pull
    is refused with INCOMPATIBLE_LAYOUT and the request is computed locally (the API server
    refuses such params up front with a 400); the prefill engine's leases on both ranks
    expire and free the blocks."""
    prefill = _engine(model, "prefill", tp=2, lease_seconds=1.0)
    decode = _engine(model, "decode")
    single = _engine(model, None)
    prompt = list(range(10, 40))
    want = _run(single, [_request("s", prompt, GREEDY)])["s"].new_token_ids
    try:
        pre = _run(prefill, [_prefill_request("p", prompt)])
        params = _params(pre["p"])
        got = _run(decode, [_request("d", prompt, GREEDY, kv_transfer_params=params)])["d"]
        assert got.new_token_ids == want
        (result,) = transfers(decode)
        assert result.reason == "INCOMPATIBLE_LAYOUT" and "tensor_parallel_size 2" in result.error
        with pytest.raises(ValueError, match=r"tensor_parallel_size 2.*this decode engine 1"):
            KVTransferParams.parse(params).check_engine("decode", 1)
        KVTransferParams.parse(params).check_engine("decode", 2)
        _drain(prefill)
        assert prefill.scheduler.make_stats().kv_leases_expired == 1
        assert prefill.scheduler.kv.usage() == 0.0
    finally:
        prefill.shutdown()
        decode.shutdown()
        single.shutdown()


@pytest.mark.slow
def test_a_dead_rank_stops_the_engine_instead_of_hanging(model: Path) -> None:
    """A tensor-parallel prefill engine whose rank 1 is killed while a lease is out: the next
    request ends in `WorkerDiedError` within seconds (the server then answers 503 and exits)."""
    prefill = _engine(model, "prefill", tp=2)
    try:
        _run(prefill, [_prefill_request("a", list(range(3, 30)))])
        assert prefill.scheduler.remote_kv.leased  # both ranks serve the lease
        assert isinstance(prefill.executor, MultiprocExecutor)
        os.kill(prefill.executor.worker_pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1"):
            _run(prefill, [_prefill_request("b", list(range(5, 40)))])
        assert time.monotonic() - start < 10
    finally:
        prefill.shutdown()
