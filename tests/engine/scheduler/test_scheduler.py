"""Tests of the scheduler driven without a model: budgets, chunking, preemption, stops, groups,
plus a hypothesis state machine that checks block accounting and the worker contract every step."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from baton.engine.kv_cache.manager import KVCacheConfig, cdiv
from baton.engine.request import Request, RequestStatus
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler.output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from baton.engine.scheduler.scheduler import Scheduler, SchedulerConfig

EOS = 0
TOKEN = 5  # what the fake model samples unless told otherwise


def make_scheduler(
    *,
    max_model_len: int = 256,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 512,
    policy: str = "fcfs",
    num_blocks: int = 64,
    block_size: int = 4,
    caching: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_model_len, max_num_seqs, max_num_batched_tokens, policy),
        KVCacheConfig(num_blocks, block_size, caching),
    )


def make_request(
    req_id: str,
    num_prompt: int = 8,
    *,
    prompt: list[int] | None = None,
    max_tokens: int | None = 4,
    priority: int = 0,
    arrival: float = 0.0,
    group_id: str | None = None,
    **params: object,
) -> Request:
    tokens = prompt if prompt is not None else [100 + i for i in range(num_prompt)]
    return Request(
        req_id,
        tokens,
        SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_ids=(EOS,),
        arrival_time=arrival,
        priority=priority,
        group_id=group_id,
    )


def sampling_ids(sched: Scheduler, out: SchedulerOutput) -> list[str]:
    """Scheduled requests whose computed tokens reached their length: the ones that sample."""
    return [
        rid
        for rid in out.num_scheduled_tokens
        if rid in sched.requests
        and sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens
    ]


def step(
    sched: Scheduler, token: int = TOKEN, tokens: dict[str, int] | None = None
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step with a fake model that samples `token` (or `tokens[req_id]`)."""
    out = sched.schedule()
    sampled = {rid: (tokens or {}).get(rid, token) for rid in sampling_ids(sched, out)}
    return out, sched.update_from_output(out, ModelRunnerOutput(sampled))


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> dict[str, list[int]]:
    """Steps until nothing is left; returns every request's generated tokens."""
    generated: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return generated
        for o in step(sched)[1]:
            generated.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("requests did not finish")


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


class SchedulerMachine(RuleBasedStateMachine):
    """Random adds, steps (with random tokens, eos included) and aborts under KV pressure.

    Alongside the scheduler it keeps a fake worker: its block tables built only from the
    SchedulerOutputs, and the token id it "wrote" into every KV slot. A prefix-cache hit is
    right only if the hit slots hold the request's own tokens.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler
        self.rng = random.Random(0)
        self.next_id = 0
        self.tables: dict[str, list[int]] = {}  # the worker's block tables
        self.slots: dict[int, list[int | None]] = {}  # block id -> token id per slot
        self.generated: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.added: dict[str, Request] = {}
        self.prefix: list[int] = []

    @initialize(
        policy=st.sampled_from(["fcfs", "priority"]),
        block_size=st.sampled_from([1, 2, 4, 8]),
        max_model_len=st.integers(8, 48),
        extra_blocks=st.integers(0, 12),
        max_num_seqs=st.integers(1, 8),
        budget=st.integers(1, 64),
        caching=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def setup(
        self,
        policy: str,
        block_size: int,
        max_model_len: int,
        extra_blocks: int,
        max_num_seqs: int,
        budget: int,
        caching: bool,
        seed: int,
    ) -> None:
        # One request at max_model_len must fit alone (the engine checks this at start-up).
        num_blocks = cdiv(max_model_len, block_size) + extra_blocks
        self.sched = make_scheduler(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            policy=policy,
            num_blocks=num_blocks,
            block_size=block_size,
            caching=caching,
        )
        self.rng = random.Random(seed)
        self.prefix = [self.rng.randrange(1, 10) for _ in range(max_model_len)]
        self.slots = {b: [None] * block_size for b in range(num_blocks)}

    # ---- operations ----

    @rule(
        num_prompt=st.integers(1, 48),
        shared=st.integers(0, 48),
        max_tokens=st.one_of(st.none(), st.integers(1, 12)),
        min_tokens=st.integers(0, 3),
        priority=st.integers(0, 3),
        num_samples=st.sampled_from([1, 1, 1, 2, 3]),
        stop=st.booleans(),
    )
    def add(
        self,
        num_prompt: int,
        shared: int,
        max_tokens: int | None,
        min_tokens: int,
        priority: int,
        num_samples: int,
        stop: bool,
    ) -> None:
        num_prompt = min(num_prompt, self.sched.config.max_model_len)
        shared = min(shared, num_prompt)
        prompt = self.prefix[:shared] + [self.rng.randrange(1, 10) for _ in range(num_prompt)]
        prompt = prompt[:num_prompt]
        if max_tokens is not None:
            min_tokens = min(min_tokens, max_tokens)
        group = f"grp{self.next_id}" if num_samples > 1 else None
        for _ in range(num_samples):
            req_id = f"r{self.next_id}"
            self.next_id += 1
            request = make_request(
                req_id,
                prompt=list(prompt),
                max_tokens=max_tokens,
                min_tokens=min_tokens,
                priority=priority,
                arrival=float(self.next_id),
                group_id=group,
                stop_token_ids=[9] if stop else [],
            )
            self.sched.add_request(request)
            self.added[req_id] = request
            self.generated[req_id] = []

    @rule(abort_mid_step=st.booleans())
    def step(self, abort_mid_step: bool) -> None:
        self._step(abort_mid_step)

    @rule(pick=st.integers(0, 2**16))
    def abort(self, pick: int) -> None:
        """Aborts any request ever added: a finished one must be left alone."""
        if not self.added:
            return
        req_id = sorted(self.added)[pick % len(self.added)]
        self.sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        self.finish.setdefault(req_id, "abort")
        assert req_id not in self.sched.requests
        assert self.sched.kv.block_ids(req_id) == []

    def _step(self, abort_mid_step: bool = False) -> None:
        sched = self.sched
        out = sched.schedule()
        self._check_output(out)
        self._run_worker(out)
        if abort_mid_step and out.num_scheduled_tokens:
            victim = self.rng.choice(sorted(out.num_scheduled_tokens))
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            self.finish[victim] = "abort"
        sampled = {rid: self.rng.randrange(0, 10) for rid in sampling_ids(sched, out)}
        for o in sched.update_from_output(out, ModelRunnerOutput(sampled)):
            assert o.request_id not in self.finish, "output after the request finished"
            assert o.new_token_ids == [sampled[o.request_id]]
            self.generated[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                self.finish[o.request_id] = o.finish_reason
                self._check_finish(o.request_id, o.finish_reason)

    # ---- what a worker would do with a SchedulerOutput ----

    def _check_output(self, out: SchedulerOutput) -> None:
        sched, config = self.sched, self.sched.config
        scheduled = out.num_scheduled_tokens
        assert out.total_num_scheduled_tokens == sum(scheduled.values())
        assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(scheduled) <= config.max_num_seqs
        assert all(n >= 1 for n in scheduled.values())
        assert not (out.preempted_req_ids & scheduled.keys())
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.tables.pop(rid, None)
        listed = [n.req_id for n in out.scheduled_new_reqs]
        listed += [c.req_id for c in out.scheduled_cached_reqs]
        assert sorted(listed) == sorted(scheduled)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.tables
            self.tables[new.req_id] = list(new.block_ids)
            self._check_hit(new.req_id, new.num_computed_tokens)
        for cached in out.scheduled_cached_reqs:
            request = sched.requests[cached.req_id]
            if cached.resumed:
                assert cached.req_id not in self.tables
                assert cached.all_token_ids == request.all_token_ids
                self.tables[cached.req_id] = list(cached.new_block_ids)
                self._check_hit(cached.req_id, cached.num_computed_tokens)
            else:
                self.tables[cached.req_id].extend(cached.new_block_ids)
            assert cached.num_computed_tokens + scheduled[cached.req_id] == (
                request.num_computed_tokens
            )
        for rid in scheduled:
            request = sched.requests[rid]
            assert request.status == RequestStatus.RUNNING
            assert self.tables[rid] == sched.kv.block_ids(rid)
            assert request.num_computed_tokens <= request.num_tokens
            assert request.num_computed_tokens <= config.max_model_len
            # The request's blocks cover exactly its computed tokens.
            assert len(self.tables[rid]) == cdiv(request.num_computed_tokens, sched.block_size)

    def _check_hit(self, req_id: str, num_hit: int) -> None:
        """Prefix-cache hits must hold what this request would have computed itself."""
        request = self.sched.requests[req_id]
        bs = self.sched.block_size
        assert num_hit % bs == 0 and num_hit < request.num_tokens
        for pos in range(num_hit):
            block = self.tables[req_id][pos // bs]
            assert self.slots[block][pos % bs] == request.all_token_ids[pos]

    def _run_worker(self, out: SchedulerOutput) -> None:
        bs = self.sched.block_size
        for rid, n in out.num_scheduled_tokens.items():
            request = self.sched.requests[rid]
            table = self.tables[rid]
            for pos in range(request.num_computed_tokens - n, request.num_computed_tokens):
                self.slots[table[pos // bs]][pos % bs] = request.all_token_ids[pos]

    def _check_finish(self, req_id: str, reason: str) -> None:
        request = self.added[req_id]
        params = request.sampling_params
        tokens = self.generated[req_id]
        assert tokens == request.output_token_ids
        if reason == "length":
            capped = params.max_tokens is not None and len(tokens) == params.max_tokens
            assert capped or request.num_tokens >= self.sched.config.max_model_len
        else:
            assert reason == "stop"
            assert len(tokens) >= params.min_tokens
            assert tokens[-1] == EOS or tokens[-1] in params.stop_token_ids
        if params.max_tokens is not None:
            assert len(tokens) <= params.max_tokens
        stops = {EOS, *params.stop_token_ids}
        assert not any(t in stops for t in tokens[params.min_tokens : -1])

    # ---- invariants after every operation ----

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        """Each block's ref_cnt is the number of requests holding it; free means ref_cnt 0."""
        kv, pool = self.sched.kv, self.sched.kv.pool
        holders: Counter[int] = Counter()
        for rid, blocks in kv.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            assert len(set(ids)) == len(ids), f"{rid} holds a block twice"
            holders.update(ids)
        free = [b.block_id for b in pool.free_queue]
        assert len(set(free)) == len(free) == pool.num_free_blocks
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id]
            assert (block.ref_cnt == 0) == (block.block_id in set(free))
        assert len(holders) + len(free) == pool.num_blocks
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash

    @invariant()
    def queues_are_consistent(self) -> None:
        """running and waiting partition the live requests; only running ones hold blocks."""
        sched = self.sched
        running = {r.request_id for r in sched.running}
        waiting = [r.request_id for r in sched.waiting]
        assert len(waiting) == len(set(waiting)) == len(sched.waiting)
        assert not running & set(waiting)
        assert running | set(waiting) == set(sched.requests)
        assert len(running) <= sched.config.max_num_seqs
        assert set(sched.kv.req_to_blocks) == running
        for request in sched.running:
            assert request.status == RequestStatus.RUNNING
            blocks = sched.kv.block_ids(request.request_id)
            assert len(blocks) == cdiv(request.num_computed_tokens, sched.block_size)
        for request in sched.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.num_computed_tokens == 0

    def teardown(self) -> None:
        """With no new requests every request finishes and every block ends up free."""
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        for _ in range(3000):
            if not sched.has_unfinished_requests():
                break
            self._step()
            self.blocks_are_accounted_for()
            self.queues_are_consistent()
        assert not sched.has_unfinished_requests(), sched.requests
        assert set(self.finish) == set(self.added)
        assert sched.requests == {} and sched.kv.req_to_blocks == {}
        assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
        assert sched._group_leaders == {}


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
