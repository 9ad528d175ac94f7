"""A hypothesis state machine over the scheduler: block accounting and the worker contract are
checked after every operation, and every request ends."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from baton.engine.request import Request, RequestStatus
from baton.engine.scheduler.output import (
    ModelRunnerOutput,
    SchedulerOutput,
)
from baton.engine.scheduler.scheduler import Scheduler
from baton.kv_transfer.params import cdiv
from tests.engine.scheduler.fakes import (
    EOS,
    make_request,
    make_scheduler,
    sampling_ids,
)


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
