"""Resumed requests in the scheduler (`output_token_ids` on the wire): they start with the
output another engine produced, computed again with the prompt like a preempted request's, and
everything that counts output tokens counts it; a grammar takes it before the first mask."""

from __future__ import annotations

import pytest

from baton.engine.protocol import EngineCoreOutput
from baton.engine.request import Request
from baton.engine.sampling_params import SamplingParams, StructuredOutputsParams
from baton.engine.scheduler.output import ModelRunnerOutput
from baton.engine.scheduler.scheduler import Scheduler
from tests.engine.scheduler.fake_grammar import FakeGrammarManager, masked_runner_output
from tests.engine.scheduler.fakes import EOS, TOKEN, make_scheduler, sampling_ids

PROMPT = [100 + i for i in range(8)]


def _resumed(req_id: str, output: list[int], **params: object) -> Request:
    return Request(
        req_id,
        PROMPT,
        SamplingParams(**params),  # type: ignore[arg-type]
        eos_token_ids=(EOS,),
        output_token_ids=output,
    )


def _run(sched: Scheduler, token: int = TOKEN) -> list[EngineCoreOutput]:
    outputs: list[EngineCoreOutput] = []
    for _ in range(100):
        if not sched.has_unfinished_requests():
            return outputs
        out = sched.schedule()
        runner = masked_runner_output(sched, out, token, sampling_ids(sched, out))
        outputs += sched.update_from_output(out, runner) + sched.take_outputs()
    raise AssertionError("the request did not finish")


def test_a_resumed_request_computes_its_output_again_then_samples_the_next_token() -> None:
    """The first step computes prompt + resumed output in one go and samples; the worker gets
    the output with the prompt; max_tokens counts the whole answer; the first token sampled
    here carries the queue time."""
    sched = make_scheduler()
    sched.add_request(_resumed("r", [1, 2, 3], max_tokens=5))
    out = sched.schedule()
    (new,) = out.scheduled_new_reqs
    assert (new.prompt_token_ids, new.output_token_ids) == (PROMPT, [1, 2, 3])
    assert out.num_scheduled_tokens == {"r": 11}
    (first,) = sched.update_from_output(out, ModelRunnerOutput({"r": TOKEN}))
    assert first.new_token_ids == [TOKEN] and first.queue_time is not None
    outputs = [first, *_run(sched)]
    assert [o.new_token_ids for o in outputs] == [[TOKEN], [TOKEN]]
    assert outputs[-1].finish_reason == "length"


def test_min_tokens_and_stop_tokens_count_the_resumed_output() -> None:
    """EOS ends the answer only once the whole answer, resumed output included, has
    min_tokens."""
    sched = make_scheduler()
    sched.add_request(_resumed("r", [1, 2, 3], max_tokens=20, min_tokens=5))
    outputs = _run(sched, token=EOS)
    assert [t for o in outputs for t in o.new_token_ids] == [EOS, EOS]
    assert outputs[-1].finish_reason == "stop"


def test_a_resumed_output_that_leaves_no_room_is_refused() -> None:
    """Resumed output that reaches max_model_len or max_tokens leaves no token to generate."""
    sched = make_scheduler(max_model_len=12)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(_resumed("a", [1, 2, 3, 4], max_tokens=None))
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add_request(_resumed("b", [1, 2], max_tokens=2))
    sched.add_request(_resumed("c", [1, 2, 3], max_tokens=None))
    assert [t for o in _run(sched) for t in o.new_token_ids] == [TOKEN]


def test_the_grammar_takes_the_resumed_output_before_its_first_mask() -> None:
    """Once compiled, the grammar consumes the resumed tokens in order (after_token_ids
    included), so the answer goes on inside it; a resumed token it refuses ends the request
    with a 400 and frees it."""
    sched = make_scheduler()
    fake = FakeGrammarManager(EOS)
    sched.structured = fake
    grammar = StructuredOutputsParams(regex="7 8 9", after_token_ids=(3,))
    sched.add_request(_resumed("ok", [1, 3, 7], max_tokens=20, structured_outputs=grammar))
    refused = StructuredOutputsParams(regex="7 8 9")
    sched.add_request(_resumed("bad", [8], max_tokens=20, structured_outputs=refused))
    assert sched.schedule().num_scheduled_tokens == {}  # both compiling
    fake.compile_all()
    outputs = _run(sched)
    assert fake.accepted["ok"] == [1, 3, 7, 8, 9, EOS]
    ok = [o for o in outputs if o.request_id == "ok"]
    assert [t for o in ok for t in o.new_token_ids] == [8, 9, EOS]
    (bad,) = [o for o in outputs if o.request_id == "bad"]
    assert (bad.finish_reason, bad.error_status) == ("error", 400)
    assert bad.error is not None and "resumed token 8" in bad.error
    assert "bad" not in sched.requests and sched.kv.usage() == 0
