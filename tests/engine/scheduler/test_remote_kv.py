"""The scheduler's remote-KV states driven through a fake connector, without sockets: parked
pulls, their success, failure under both policies, aborts mid-pull, prefix hits that release
the lease, refused params, and leases claimed or expired on the prefill side."""

from __future__ import annotations

import pytest

from baton.engine.protocol import EngineCoreOutput
from baton.engine.request import RequestStatus
from baton.engine.scheduler.scheduler import Scheduler
from baton.kv_transfer.params import KVTransferParams, RemotePrefill, cdiv
from tests.engine.scheduler.fake_connector import FakeConnector
from tests.engine.scheduler.fakes import TOKEN, make_request, make_scheduler, step

BLOCK = 4


def remote(num_prompt: int, policy: str | None = None) -> KVTransferParams:
    blocks = list(range(100, 100 + cdiv(num_prompt, BLOCK)))
    lease = RemotePrefill("e1", "10.0.0.1", 7000, "p", blocks, num_prompt, 1e12, (7000,))
    return KVTransferParams(remote=lease, load_failure_policy=policy)


def engine_step(sched: Scheduler, kv: FakeConnector) -> tuple[dict[str, int], list]:
    """What `EngineCore.step` does: a model step, then the connector's worker half."""
    out, outputs = step(sched)
    kv.sync()
    outputs += sched.update_from_kv_output(kv.get_finished())
    return out.num_scheduled_tokens, outputs


def setup(policy: str = "recompute", **kw: int) -> tuple[Scheduler, FakeConnector]:
    kv = FakeConnector(block_size=BLOCK, policy=policy)
    return make_scheduler(block_size=BLOCK, connector=kv, **kw), kv


def finished(outputs: list[EngineCoreOutput]) -> dict[str, EngineCoreOutput]:
    return {o.request_id: o for o in outputs if o.finished}


def test_pulled_request_resumes_with_only_its_last_token_to_compute() -> None:
    """A decode request waits in WAITING_FOR_REMOTE_KVS (counted as waiting) with blocks for its
    prompt; once the pull succeeds it computes one token, samples, and frees everything."""
    sched, kv = setup()
    sched.add_request(make_request("d", 10, max_tokens=2, kv_transfer_params=remote(10)))
    scheduled, _ = engine_step(sched, kv)
    request = sched.requests["d"]
    assert scheduled == {} and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(sched.kv.block_ids("d")) == cdiv(10, BLOCK)
    (load,) = kv.loads.values()
    assert load.remote_block_ids == [100, 101, 102] and len(load.local_block_ids) == 3
    stats = sched.make_stats()
    assert (stats.num_waiting, stats.num_running) == (1, 0)
    assert engine_step(sched, kv)[0] == {}  # still pulling: nothing to compute
    kv.end_load("d")
    engine_step(sched, kv)
    assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 9
    scheduled, _ = engine_step(sched, kv)
    assert scheduled == {"d": 1}
    _, outputs = engine_step(sched, kv)
    assert finished(outputs)["d"].finish_reason == "length"
    assert sched.kv.usage() == 0.0 and not sched.has_unfinished_requests()
    (result,) = sched.make_stats().kv_transfers
    assert result.ok and result.num_bytes == 300


def test_failed_pull_recomputes_the_whole_prompt() -> None:
    """Policy recompute: the request starts over locally, its pulled blocks dropped."""
    sched, kv = setup("recompute")
    sched.add_request(make_request("d", 10, max_tokens=1, kv_transfer_params=remote(10)))
    engine_step(sched, kv)
    kv.end_load("d", "DEADLINE: too slow")
    engine_step(sched, kv)
    assert sched.requests["d"].num_computed_tokens == 0
    scheduled, outputs = engine_step(sched, kv)
    assert scheduled == {"d": 10}
    assert finished(outputs)["d"].new_token_ids == [TOKEN]
    assert [r.reason for r in sched.make_stats().kv_transfers] == ["DEADLINE"]
    assert sched.kv.usage() == 0.0


@pytest.mark.parametrize(("engine", "own"), [("fail", None), ("recompute", "fail")])
def test_failed_pull_under_policy_fail_ends_with_an_error(engine: str, own: str | None) -> None:
    """Policy fail (the engine's, or the request's own over the engine's): the request ends with
    finish_reason "error" and a message naming the failure; no block is left behind."""
    sched, kv = setup(engine)
    sched.add_request(make_request("d", 10, kv_transfer_params=remote(10, own)))
    engine_step(sched, kv)
    kv.end_load("d", "CHECKSUM_MISMATCH: block 3")
    _, outputs = engine_step(sched, kv)
    out = finished(outputs)["d"]
    assert out.finish_reason == "error" and "CHECKSUM_MISMATCH" in (out.error or "")
    assert sched.kv.usage() == 0.0 and not sched.requests


def test_abort_while_pulling_keeps_the_blocks_until_the_loader_is_done() -> None:
    """The loader may still write into an aborted request's blocks: they are freed only when
    its pull reports."""
    sched, kv = setup()
    sched.add_request(make_request("d", 10, kv_transfer_params=remote(10)))
    engine_step(sched, kv)
    sched.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests() and sched.kv.usage() > 0
    kv.end_load("d")
    engine_step(sched, kv)
    assert sched.kv.usage() == 0.0


def test_prompt_cached_here_releases_the_remote_lease() -> None:
    """A decode engine that caches the whole prompt pulls nothing, tells the prefill engine so
    (release) and computes just the last token."""
    sched, kv = setup()
    prompt = [7 + i for i in range(9)]
    sched.add_request(make_request("warm", prompt=prompt, max_tokens=1))
    engine_step(sched, kv)
    sched.add_request(make_request("d", prompt=prompt, max_tokens=1, kv_transfer_params=remote(9)))
    scheduled, _ = engine_step(sched, kv)
    assert scheduled == {"d": 1} and kv.releases == ["p"] and not kv.loads


def test_params_for_another_prompt_are_refused_and_computed_locally() -> None:
    """Params describing another prompt length are never pulled: the request is computed here
    and the refusal is counted with the transfers."""
    sched, kv = setup()
    sched.add_request(make_request("d", 10, max_tokens=1, kv_transfer_params=remote(12)))
    scheduled, _ = engine_step(sched, kv)
    assert scheduled == {"d": 10} and not kv.loads
    assert [r.reason for r in sched.make_stats().kv_transfers] == ["BAD_PARAMS"]


def test_pull_waits_for_room_for_its_blocks() -> None:
    """A decode request whose blocks do not fit stays in `waiting` (not parked) until they do."""
    sched, kv = setup(num_blocks=4)
    sched.add_request(make_request("big", 12, max_tokens=1))
    sched.add_request(make_request("d", 10, max_tokens=1, kv_transfer_params=remote(10)))
    scheduled, _ = engine_step(sched, kv)
    assert scheduled == {"big": 12} and sched.requests["d"].status == RequestStatus.WAITING
    engine_step(sched, kv)  # "big" finished during the first step: its blocks are back
    assert sched.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS


@pytest.mark.parametrize("end", ["claim", "expire"])
def test_prefill_lease_holds_blocks_until_claimed_or_expired(end: str) -> None:
    """A do_remote_decode request answers with a lease on its prompt blocks, which stay held
    (and counted) until a reader claims them or the lease expires."""
    sched, kv = setup()
    sched.add_request(
        make_request("p", 10, max_tokens=1, kv_transfer_params=KVTransferParams(True))
    )
    _, outputs = engine_step(sched, kv)
    params = finished(outputs)["p"].kv_transfer_params
    assert params is not None and params.remote is not None
    assert len(params.remote.block_ids) == 3 and params.remote.num_prompt_tokens == 10
    assert not sched.has_unfinished_requests() and sched.kv.usage() > 0
    assert sched.make_stats().kv_blocks_leased == 3
    getattr(kv, end)("p")
    engine_step(sched, kv)
    stats = sched.make_stats()
    assert stats.kv_blocks_leased == 0 and sched.kv.usage() == 0.0
    assert stats.kv_leases_expired == (1 if end == "expire" else 0)
