"""The scheduler's structured-output path, driven with a fake grammar manager: requests wait
for their grammar without blocking the queue, a compile error ends one, each sampling step
carries the mask rows of exactly the constrained requests that sample (in batch order), and
the grammar sees every sampled token once, across preemption, n > 1 and async scheduling."""

from __future__ import annotations

import pytest

from baton.engine.request import Request, RequestStatus
from baton.engine.sampling_params import StructuredOutputsParams
from baton.engine.scheduler.output import ModelRunnerOutput, SchedulerOutput
from baton.engine.scheduler.scheduler import Scheduler
from baton.kv_transfer.params import KVTransferParams, RemotePrefill
from tests.engine.scheduler.fake_connector import FakeConnector
from tests.engine.scheduler.fake_grammar import (
    VOCAB,
    FakeGrammarManager,
    allowed_tokens,
    masked_runner_output,
)
from tests.engine.scheduler.fakes import EOS, TOKEN, make_request, make_scheduler, sampling_ids

SEQ = [7, 8, 9]


def _grammar(seq: list[int] = SEQ, after: tuple[int, ...] | None = None) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=" ".join(map(str, seq)), after_token_ids=after)


def _constrained(req_id: str, num_prompt: int = 8, **kw: object) -> Request:
    grammar = kw.pop("grammar", _grammar())
    return make_request(req_id, num_prompt, structured_outputs=grammar, **kw)  # type: ignore[arg-type]


def _setup(instant: bool = True, **kw: object) -> tuple[Scheduler, FakeGrammarManager]:
    sched = make_scheduler(**kw)  # type: ignore[arg-type]
    fake = FakeGrammarManager(EOS, instant=instant)
    sched.structured = fake
    return sched, fake


def _step(sched: Scheduler, token: int = TOKEN) -> tuple[SchedulerOutput, list]:
    out = sched.schedule()
    runner = masked_runner_output(sched, out, token, sampling_ids(sched, out))
    return out, sched.update_from_output(out, runner) + sched.take_outputs()


def _run(sched: Scheduler, max_steps: int = 200) -> dict[str, tuple[list[int], str | None]]:
    got: dict[str, tuple[list[int], str | None]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return got
        for o in _step(sched)[1]:
            tokens, _ = got.get(o.request_id, ([], None))
            got[o.request_id] = (tokens + o.new_token_ids, o.finish_reason)
    raise AssertionError("requests did not finish")


def test_a_constrained_answer_follows_its_grammar_and_ends_with_eos() -> None:
    """The request samples the grammar's tokens, then EOS ("stop"); the grammar saw each once
    and is removed when the request ends."""
    sched, fake = _setup()
    sched.add_request(_constrained("a", max_tokens=10))
    assert _run(sched) == {"a": ([*SEQ, EOS], "stop")}
    assert fake.accepted["a"] == [*SEQ, EOS]
    assert fake.removed == ["a"]


def test_a_request_waits_for_its_grammar_without_blocking_the_queue() -> None:
    """Until its grammar compiles the request stays WAITING_FOR_FSM and requests behind it are
    scheduled; then it runs, keeping its place."""
    sched, fake = _setup(instant=False)
    sched.add_request(_constrained("a"))
    sched.add_request(make_request("b"))
    assert sched.requests["a"].status == RequestStatus.WAITING_FOR_FSM
    out, _ = _step(sched)
    assert list(out.num_scheduled_tokens) == ["b"]
    assert sched.requests["a"].status == RequestStatus.WAITING_FOR_FSM
    assert sched.waiting.peek().request_id == "a"  # still at the head
    fake.compile_all()
    out, _ = _step(sched)
    assert list(out.num_scheduled_tokens) == ["b", "a"]
    assert out.structured_output_request_ids == ["a"]


def test_a_grammar_that_fails_to_compile_ends_the_request_with_an_error() -> None:
    """finish_reason "error" with the compiler's message; nothing is allocated, nothing hangs,
    and the request behind it runs."""
    sched, fake = _setup()
    sched.add_request(_constrained("a", grammar=StructuredOutputsParams(regex="!bad regex")))
    sched.add_request(make_request("b", max_tokens=1))
    out, outputs = _step(sched)
    errors = [o for o in outputs if o.request_id == "a"]
    assert len(errors) == 1
    assert errors[0].finish_reason == "error" and errors[0].error == "bad regex"
    assert errors[0].new_token_ids == []
    assert "a" not in out.num_scheduled_tokens and "a" not in sched.requests
    assert fake.removed[0] == "a"
    assert not sched.has_unfinished_requests()
    assert sched.kv.usage() == 0.0


def test_rows_follow_the_batch_and_skip_prompt_chunks_and_free_requests() -> None:
    """A step's mask rows are the constrained requests that sample, in batch order; a free
    request and a constrained one mid-prompt (chunked prefill) have no row."""
    sched, _fake = _setup(max_num_batched_tokens=20)
    sched.add_request(_constrained("c1", 8))
    sched.add_request(make_request("f", 8))
    sched.add_request(_constrained("c2", 12, grammar=_grammar([20, 21])))  # 4 of 12 this step
    out, _ = _step(sched)
    assert out.num_scheduled_tokens == {"c1": 8, "f": 8, "c2": 4}
    assert out.structured_output_request_ids == ["c1"]
    assert out.grammar_bitmask is not None and out.grammar_bitmask.shape == (1, VOCAB // 32)
    assert allowed_tokens(out.grammar_bitmask[0]) == [7]
    out, _ = _step(sched)  # c2's prompt ends: it samples too
    assert list(out.num_scheduled_tokens) == ["c1", "f", "c2"]
    assert out.structured_output_request_ids == ["c1", "c2"]
    assert [allowed_tokens(r) for r in out.grammar_bitmask] == [[8], [20]]  # type: ignore[union-attr]


def test_a_step_with_only_free_requests_has_no_mask() -> None:
    sched, _ = _setup()
    sched.add_request(make_request("f"))
    out, _ = _step(sched)
    assert out.grammar_bitmask is None and out.structured_output_request_ids == []


def test_a_rejected_token_ends_the_request_with_an_error(caplog: pytest.LogCaptureFixture) -> None:
    """A token the grammar refused (constraints that left it no token, or one too costly) is
    not appended: the request ends with an error, a 400 (the request's doing), logged."""
    sched, fake = _setup()
    sched.add_request(_constrained("a"))
    out = sched.schedule()
    outputs = sched.update_from_output(out, ModelRunnerOutput({"a": 50}))
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([], "error")]
    assert "grammar" in (outputs[0].error or "") and outputs[0].error_status == 400
    assert any("grammar" in r.getMessage() for r in caplog.records)
    assert "a" not in sched.requests and fake.removed == ["a"]


def test_preemption_keeps_the_grammar_state_and_replays_nothing() -> None:
    """A constrained request preempted mid-answer resumes where its grammar was: the grammar
    sees each output token once, the answer is whole."""
    seq = list(range(10, 22))
    sched, fake = _setup(num_blocks=7, block_size=4, caching=False)
    sched.add_request(make_request("f", 8, max_tokens=14, ignore_eos=True))
    sched.add_request(_constrained("c", 8, grammar=_grammar(seq), max_tokens=20))
    got = _run(sched)
    assert sched.num_preemptions >= 1
    assert got["c"] == ([*seq, EOS], "stop")
    assert fake.accepted["c"] == [*seq, EOS]
    assert got["f"] == ([TOKEN] * 14, "length")


def test_n_siblings_each_have_their_own_grammar_state() -> None:
    """Samples of one prompt (a group) are separate requests: each advances its own matcher."""
    sched, fake = _setup()
    for i in range(3):
        sched.add_request(_constrained(f"p-{i}", 9, group_id="p", max_tokens=10))
    got = _run(sched)
    assert got == {f"p-{i}": ([*SEQ, EOS], "stop") for i in range(3)}
    assert all(fake.accepted[f"p-{i}"] == [*SEQ, EOS] for i in range(3))


def test_max_tokens_cuts_a_constrained_answer_with_length() -> None:
    sched, fake = _setup()
    sched.add_request(_constrained("a", max_tokens=2))
    assert _run(sched) == {"a": (SEQ[:2], "length")}
    assert fake.removed == ["a"]


@pytest.mark.parametrize("params", [{"min_tokens": 6}, {"ignore_eos": True}])
def test_a_complete_grammar_ends_the_request_when_eos_is_blocked(params: dict) -> None:
    """Once the grammar is complete only EOS is allowed; with min_tokens not reached (or
    ignore_eos) EOS cannot end it, so the request ends with "stop" and no EOS rather than
    sampling from a row where nothing is allowed."""
    sched, _ = _setup()
    sched.add_request(_constrained("a", max_tokens=10, **params))
    outputs = []
    while sched.has_unfinished_requests():
        outputs += _step(sched)[1]
    # The last answer token goes out unfinished, then an empty "stop": the output side drops
    # the text of a "stop" output's last token (an EOS or stop token's), not this one's.
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [
        ([7], None),
        ([8], None),
        ([9], None),
        ([], "stop"),
    ]


def test_the_constraint_starts_after_the_reasoning_end() -> None:
    """With after_token_ids the rows allow everything until the output ends with them."""
    sched, _fake = _setup()
    sched.add_request(_constrained("a", grammar=_grammar(after=(TOKEN, TOKEN)), max_tokens=10))
    assert _run(sched) == {"a": ([TOKEN, TOKEN, *SEQ, EOS], "stop")}


def test_async_scheduling_never_builds_a_mask_before_the_token_it_depends_on() -> None:
    """With a step in flight, a constrained request whose token is not back is not scheduled
    (its mask would be stale) while a free one is; needs_sampled_tokens says to wait."""
    sched, _fake = _setup()
    sched.add_request(_constrained("c"))
    sched.add_request(make_request("f", max_tokens=10))
    first = sched.schedule()  # both prefill and sample
    assert sched.needs_sampled_tokens()
    second = sched.schedule()  # scheduled before the first step's tokens are back
    assert list(second.num_scheduled_tokens) == ["f"]
    assert second.grammar_bitmask is None
    sched.update_from_output(first, masked_runner_output(sched, first, TOKEN, ["c", "f"]))
    assert not sched.needs_sampled_tokens()
    sched.update_from_output(second, ModelRunnerOutput({"f": TOKEN}))
    third = sched.schedule()
    assert third.structured_output_request_ids == ["c"]
    assert allowed_tokens(third.grammar_bitmask[0]) == [8]  # type: ignore[index]


def test_aborting_a_request_waiting_for_its_grammar_removes_it() -> None:
    sched, fake = _setup(instant=False)
    sched.add_request(_constrained("a"))
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert fake.removed == ["a"] and not sched.has_unfinished_requests()


def test_a_scheduler_without_a_grammar_backend_refuses_constrained_requests() -> None:
    sched = make_scheduler()
    with pytest.raises(ValueError, match="structured-output"):
        sched.add_request(_constrained("a"))
    assert not sched.has_unfinished_requests()


def test_a_pulled_decode_request_samples_its_first_token_under_the_mask() -> None:
    """P/D: a constrained decode request whose prompt KV is pulled waits for its grammar, then
    for its pull, then computes its last prompt token and samples it under the mask."""
    kv = FakeConnector(block_size=4)
    sched = make_scheduler(block_size=4, connector=kv)
    fake = FakeGrammarManager(EOS, instant=False)
    sched.structured = fake
    lease = RemotePrefill("e1", "10.0.0.1", 7000, "p", [100, 101, 102], 10, 1e12, (7000,))
    sched.add_request(
        _constrained("d", 10, max_tokens=10, kv_transfer_params=KVTransferParams(remote=lease))
    )

    def engine_step() -> tuple[SchedulerOutput, list]:
        out, outputs = _step(sched)
        kv.sync()
        return out, outputs + sched.update_from_kv_output(kv.get_finished())

    engine_step()
    assert sched.requests["d"].status == RequestStatus.WAITING_FOR_FSM and not kv.loads
    fake.compile_all()
    engine_step()
    assert sched.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    kv.end_load("d")
    engine_step()
    out, outputs = engine_step()
    assert out.num_scheduled_tokens == {"d": 1}
    assert out.structured_output_request_ids == ["d"]
    assert [o.new_token_ids for o in outputs] == [[SEQ[0]]]


def test_a_request_preempted_with_its_token_in_flight_resumes_after_it() -> None:
    """Async scheduling: a constrained request preempted while its token is in flight is not
    resumed (its mask would be stale) until that token is back and fed to its grammar."""
    sched, fake = _setup()
    sched.add_request(_constrained("c"))
    first = sched.schedule()
    sched._preempt(sched.requests["c"])  # as a step that runs out of blocks would
    assert sched.needs_sampled_tokens()
    assert "c" not in sched.schedule().num_scheduled_tokens
    sched.update_from_output(first, ModelRunnerOutput({"c": SEQ[0]}))
    assert fake.accepted["c"] == [SEQ[0]] and not sched.needs_sampled_tokens()
    resumed = sched.schedule()
    assert resumed.structured_output_request_ids == ["c"]
    assert allowed_tokens(resumed.grammar_bitmask[0]) == [SEQ[1]]  # type: ignore[index]


def test_is_compiling_tracks_requests_waiting_for_their_grammar() -> None:
    sched, fake = _setup(instant=False)
    sched.add_request(_constrained("a"))
    sched.add_request(_constrained("b"))
    assert sched.is_compiling()
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    fake.compile_all()
    sched.schedule()
    assert not sched.is_compiling()
