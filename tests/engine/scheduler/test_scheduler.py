"""Tests of the scheduler driven without a model: budgets, chunking, preemption, stops, groups."""

from __future__ import annotations

import pytest

from baton.engine.protocol import EngineCoreOutput
from baton.engine.request import RequestStatus
from baton.engine.scheduler.output import CachedRequestData, ModelRunnerOutput
from baton.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from baton.kv_transfer.params import cdiv
from tests.engine.scheduler.fakes import (
    EOS,
    TOKEN,
    make_request,
    make_scheduler,
    run_to_completion,
    sampling_ids,
    step,
)

# ---- validation ------------------------------------------------------------------------------


def test_prompt_longer_than_max_model_len_raises() -> None:
    """add_request refuses a prompt over max_model_len; one of exactly max_model_len is accepted."""
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("a", 17))
    sched.add_request(make_request("b", 16))
    assert "a" not in sched.requests
    assert sched.get_num_unfinished_requests() == 1


def test_empty_prompt_raises() -> None:
    """add_request refuses an empty prompt."""
    sched = make_scheduler()
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("a", prompt=[]))
    assert not sched.has_unfinished_requests()


def test_duplicate_request_id_raises() -> None:
    """A request id in use cannot be added again."""
    sched = make_scheduler()
    sched.add_request(make_request("a"))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a"))


def test_config_validation() -> None:
    """Non-positive limits and unknown policies raise ValueError."""
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_model_len=16, max_num_seqs=0)
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(max_model_len=16, policy="lifo")


# ---- budgets ---------------------------------------------------------------------------------


def test_token_budget_is_respected_and_the_last_prompt_is_chunked() -> None:
    """With a 128-token budget, 100 + 28 tokens are scheduled: the second prompt is chunked."""
    sched = make_scheduler(max_num_batched_tokens=128)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 100))
    out, outputs = step(sched)
    assert out.num_scheduled_tokens == {"r0": 100, "r1": 28}
    assert out.total_num_scheduled_tokens == 128
    assert [o.request_id for o in outputs] == ["r0"]
    for _ in range(20):
        out, _ = step(sched)
        assert out.total_num_scheduled_tokens <= 128
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens


def test_max_num_seqs_is_respected() -> None:
    """Only max_num_seqs requests run at once; the next is admitted when one finishes."""
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_request("a", max_tokens=1))
    sched.add_request(make_request("b", max_tokens=3))
    sched.add_request(make_request("c", max_tokens=3))
    out, outputs = step(sched)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert [o.request_id for o in outputs if o.finished] == ["a"]
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["b", "c"]
    assert out.finished_req_ids == {"a"}
    assert len(sched.running) == 2


def test_chunked_prefill_splits_a_long_prompt_across_steps() -> None:
    """A 300-token prompt under a 128 budget runs as 128, 128, 44 and samples after the last."""
    sched = make_scheduler(max_num_batched_tokens=128, max_model_len=512, num_blocks=128)
    sched.add_request(make_request("a", 300))
    chunks = []
    for _ in range(3):
        out, outputs = step(sched)
        chunks.append(out.num_scheduled_tokens["a"])
        assert len(outputs) == (1 if len(chunks) == 3 else 0)
    assert chunks == [128, 128, 44]
    assert out.scheduled_cached_reqs[0].num_computed_tokens == 256
    request = sched.requests["a"]
    assert request.num_computed_tokens == 300 and request.output_token_ids == [TOKEN]
    assert len(sched.kv.block_ids("a")) == cdiv(300, 4)


def test_running_requests_are_served_before_waiting_ones() -> None:
    """A running decode is scheduled first even when a waiting prompt could fill the budget."""
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add_request(make_request("a", 8, max_tokens=10))
    step(sched)
    sched.add_request(make_request("b", 200))
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 63)]
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["a"]
    assert [n.req_id for n in out.scheduled_new_reqs] == ["b"]


# ---- preemption ------------------------------------------------------------------------------


def test_preempted_request_resumes_and_finishes_with_all_its_tokens() -> None:
    """When blocks run out the last request is preempted, resumes with resumed=True and its
    tokens so far, and still ends with exactly max_tokens tokens."""
    sched = make_scheduler(num_blocks=6, block_size=4, caching=False)
    sched.add_request(make_request("a", 8, max_tokens=8))
    sched.add_request(make_request("b", 8, max_tokens=8))
    generated: dict[str, list[int]] = {"a": [], "b": []}
    preempted_at = None
    resumed: list[CachedRequestData] = []
    for i in range(60):
        if not sched.has_unfinished_requests():
            break
        tokens = {"a": 10 + i, "b": 40 + i}
        out = sched.schedule()
        if out.preempted_req_ids:
            assert out.preempted_req_ids == {"b"}  # fcfs: the last admitted
            assert "b" not in out.num_scheduled_tokens
            preempted_at = preempted_at or i
            assert sched.requests["b"].status == RequestStatus.PREEMPTED
            assert sched.kv.block_ids("b") == []
        for c in out.scheduled_cached_reqs:
            if c.resumed:
                resumed.append(c)
                request = sched.requests[c.req_id]
                assert c.all_token_ids == request.prompt_token_ids + generated[c.req_id]
                assert c.num_computed_tokens == 0  # no prefix caching here
                assert c.new_block_ids == sched.kv.block_ids(c.req_id)
        sampled = {rid: tokens[rid] for rid in sampling_ids(sched, out)}
        for o in sched.update_from_output(out, ModelRunnerOutput(sampled)):
            generated[o.request_id].extend(o.new_token_ids)
    assert preempted_at is not None
    assert [c.req_id for c in resumed] == ["b"]
    assert sched.num_preemptions == 1
    assert len(generated["a"]) == len(generated["b"]) == 8
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == 6


def test_resumed_request_hits_its_own_cached_blocks() -> None:
    """With prefix caching, a preempted request finds its computed full blocks again on resume."""
    sched = make_scheduler(num_blocks=5, block_size=4)
    sched.add_request(make_request("a", 8, max_tokens=10))
    sched.add_request(make_request("b", 5, max_tokens=10))
    resumed = []
    for _ in range(60):
        if not sched.has_unfinished_requests():
            break
        out, _ = step(sched)
        resumed += [c for c in out.scheduled_cached_reqs if c.resumed]
    assert resumed and resumed[0].req_id == "b"
    assert resumed[0].num_computed_tokens >= 4
    assert resumed[0].num_computed_tokens % 4 == 0


def _two_requests_that_collide(policy: str) -> Scheduler:
    """a (priority 10, admitted first) and b (priority 0) fill 2 blocks; b then needs a third."""
    sched = make_scheduler(num_blocks=2, block_size=4, policy=policy, caching=False)
    sched.add_request(make_request("a", 1, max_tokens=20, priority=10, arrival=0.0))
    step(sched)  # a: 1 computed, 2 tokens
    sched.add_request(make_request("b", 4, max_tokens=20, priority=0, arrival=1.0))
    step(sched)  # a: 2 computed, b: 4 computed (its block is full)
    return sched


def test_fcfs_preempts_the_last_admitted_request() -> None:
    """Under fcfs the victim is the newest running request, here the one asking for a block."""
    sched = _two_requests_that_collide("fcfs")
    out, _ = step(sched)
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in sched.running] == ["a"]


def test_priority_preempts_the_least_urgent_even_if_already_scheduled() -> None:
    """Under priority the victim is the largest priority value, even one scheduled earlier in
    the same step: its tokens go back to the budget and are not reported as scheduled."""
    sched = _two_requests_that_collide("priority")
    out, _ = step(sched)
    assert out.preempted_req_ids == {"a"}
    assert out.num_scheduled_tokens == {"b": 1}
    assert out.total_num_scheduled_tokens == 1
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["b"]
    assert sched.kv.block_ids("a") == []
    assert sched.requests["a"].num_computed_tokens == 0


def test_no_new_request_is_admitted_in_a_step_that_preempted() -> None:
    """A step that had to preempt admits nobody from the waiting queue."""
    sched = _two_requests_that_collide("fcfs")
    sched.add_request(make_request("c", 1, max_tokens=2))
    out, _ = step(sched)
    assert out.preempted_req_ids == {"b"}
    assert out.scheduled_new_reqs == []


def test_fcfs_admits_in_arrival_order() -> None:
    """fcfs admits in the order requests were added, ignoring priority."""
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("low", priority=5, arrival=0.0, max_tokens=1))
    sched.add_request(make_request("high", priority=0, arrival=1.0, max_tokens=1))
    order = [next(iter(step(sched)[0].num_scheduled_tokens)) for _ in range(2)]
    assert order == ["low", "high"]


def test_priority_admits_lowest_value_first_then_earliest_arrival() -> None:
    """priority admits the smallest priority value first, ties broken by arrival time."""
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    sched.add_request(make_request("low", priority=5, arrival=0.0, max_tokens=1))
    sched.add_request(make_request("high-late", priority=0, arrival=2.0, max_tokens=1))
    sched.add_request(make_request("high-early", priority=0, arrival=1.0, max_tokens=1))
    order = [next(iter(step(sched)[0].num_scheduled_tokens)) for _ in range(3)]
    assert order == ["high-early", "high-late", "low"]


# ---- stop conditions -------------------------------------------------------------------------


def test_eos_stops_with_reason_stop() -> None:
    """Sampling an eos token finishes the request with finish_reason "stop"."""
    sched = make_scheduler()
    sched.add_request(make_request("a", max_tokens=10))
    step(sched)
    _, outputs = step(sched, token=EOS)
    assert outputs[0].finish_reason == "stop" and outputs[0].stop_reason is None
    assert outputs[0].new_token_ids == [EOS]
    assert not sched.has_unfinished_requests()


def test_ignore_eos_keeps_generating() -> None:
    """With ignore_eos an eos token does not stop the request; max_tokens does."""
    sched = make_scheduler()
    sched.add_request(make_request("a", max_tokens=3, ignore_eos=True))
    outs = [step(sched, token=EOS)[1][0] for _ in range(3)]
    assert [o.finish_reason for o in outs] == [None, None, "length"]


def test_stop_token_ids_stop_and_report_the_token() -> None:
    """A token in stop_token_ids stops the request and is its stop_reason."""
    sched = make_scheduler()
    sched.add_request(make_request("a", max_tokens=10, stop_token_ids=[42]))
    step(sched)
    _, outputs = step(sched, token=42)
    assert outputs[0].finish_reason == "stop" and outputs[0].stop_reason == 42


def test_max_tokens_stops_with_reason_length() -> None:
    """A request ends with finish_reason "length" after exactly max_tokens tokens."""
    sched = make_scheduler()
    sched.add_request(make_request("a", max_tokens=5))
    generated = run_to_completion(sched)
    assert generated == {"a": [TOKEN] * 5}


def test_max_model_len_caps_generation() -> None:
    """Without max_tokens a request stops with "length" when it reaches max_model_len tokens."""
    sched = make_scheduler(max_model_len=13)
    sched.add_request(make_request("a", 10, max_tokens=None))
    outputs: list[EngineCoreOutput] = []
    while sched.has_unfinished_requests():
        outputs += step(sched)[1]
    assert len(outputs) == 3
    assert outputs[-1].finish_reason == "length"


def test_min_tokens_delays_eos_and_stop_tokens() -> None:
    """eos and stop tokens sampled before min_tokens are kept and do not stop the request."""
    sched = make_scheduler()
    sched.add_request(make_request("a", max_tokens=10, min_tokens=3, stop_token_ids=[42]))
    outs = [step(sched, token=t)[1][0] for t in (EOS, 42, EOS)]
    assert [o.finish_reason for o in outs] == [None, None, "stop"]
    assert sched.requests == {}


# ---- aborts ----------------------------------------------------------------------------------


def test_abort_of_a_running_request_frees_its_blocks_at_once() -> None:
    """Aborting a running request returns its blocks immediately and reports it finished."""
    sched = make_scheduler(num_blocks=16)
    sched.add_request(make_request("a", 20, max_tokens=10))
    step(sched)
    assert sched.kv.num_free_blocks < 16
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == 16
    assert sched.kv.req_to_blocks == {}
    assert not sched.has_unfinished_requests()
    out, _ = step(sched)
    assert out.finished_req_ids == {"a"}
    assert out.num_scheduled_tokens == {}


def test_abort_of_a_waiting_request_removes_it_from_the_queue() -> None:
    """An aborted waiting request is never scheduled, under either policy."""
    for policy in ("fcfs", "priority"):
        sched = make_scheduler(policy=policy)
        sched.add_request(make_request("a"))
        sched.add_request(make_request("b"))
        sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
        out, _ = step(sched)
        assert list(out.num_scheduled_tokens) == ["b"]
        assert out.finished_req_ids == {"a"}


def test_abort_during_a_step_drops_its_output() -> None:
    """A request aborted between schedule() and update_from_output() produces no output."""
    sched = make_scheduler()
    sched.add_request(make_request("a"))
    sched.add_request(make_request("b"))
    out = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    outputs = sched.update_from_output(out, ModelRunnerOutput({"a": 1, "b": 1}))
    assert [o.request_id for o in outputs] == ["b"]
    assert sched.kv.block_ids("a") == []


def test_finish_requests_refuses_a_non_finished_status() -> None:
    """finish_requests needs a finished status."""
    sched = make_scheduler()
    sched.add_request(make_request("a"))
    with pytest.raises(ValueError, match="not a finished status"):
        sched.finish_requests("a", RequestStatus.RUNNING)


# ---- n > 1 groups ----------------------------------------------------------------------------


def test_group_siblings_wait_for_the_leader_then_hit_its_prompt_blocks() -> None:
    """Samples of one prompt wait for the first to compute it, then all hit its full prompt
    blocks at once (and share them), instead of each recomputing the prompt."""
    sched = make_scheduler(block_size=16)
    prompt = list(range(1, 41))  # 40 tokens: 2 full blocks + 8
    for k in range(4):
        sched.add_request(make_request(f"g{k}", prompt=prompt, max_tokens=4, group_id="g"))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"g0": 40}
    out, _ = step(sched)
    siblings = {n.req_id: n for n in out.scheduled_new_reqs}
    assert set(siblings) == {"g1", "g2", "g3"}
    full_prompt_blocks = 40 // 16
    leader_blocks = sched.kv.req_to_blocks["g0"][:full_prompt_blocks]
    for rid, new in siblings.items():
        assert new.num_computed_tokens == full_prompt_blocks * 16
        assert out.num_scheduled_tokens[rid] == 40 - full_prompt_blocks * 16
        assert sched.requests[rid].num_cached_tokens == full_prompt_blocks * 16
        assert sched.kv.req_to_blocks[rid][:full_prompt_blocks] == leader_blocks
    assert [b.ref_cnt for b in leader_blocks] == [4, 4]
    generated = run_to_completion(sched)
    assert {rid: len(tokens) for rid, tokens in generated.items()} == {
        "g0": 2,  # sampled its first 2 tokens in the steps above
        "g1": 3,
        "g2": 3,
        "g3": 3,
    }
    assert sched.kv.num_free_blocks == 64


def test_group_without_prefix_caching_is_not_deferred() -> None:
    """Without prefix caching there is nothing to wait for: all samples start together."""
    sched = make_scheduler(caching=False)
    for k in range(3):
        sched.add_request(make_request(f"g{k}", 20, group_id="g"))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"g0": 20, "g1": 20, "g2": 20}


def test_deferred_siblings_keep_their_place_ahead_of_later_requests() -> None:
    """Siblings deferred behind their leader stay ahead of requests added after them."""
    sched = make_scheduler(block_size=4, max_num_seqs=3)
    for k in range(3):
        sched.add_request(make_request(f"g{k}", 9, group_id="g", max_tokens=2))
    sched.add_request(make_request("x", 9, max_tokens=2))
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["g0", "x"]
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["g0", "x", "g1"]


def test_prefix_hit_allocates_only_the_missing_blocks() -> None:
    """A new request with a cached prefix holds exactly ceil(tokens / block_size) blocks."""
    sched = make_scheduler(block_size=16)
    prompt = list(range(1, 41))
    sched.add_request(make_request("a", prompt=prompt, max_tokens=4))
    step(sched)
    sched.add_request(make_request("b", prompt=prompt, max_tokens=4))
    out, _ = step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 32
    assert len(out.scheduled_new_reqs[0].block_ids) == 3
    assert len(sched.kv.block_ids("b")) == 3


# ---- property-based: a random engine life ----------------------------------------------------
