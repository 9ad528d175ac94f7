"""Structured outputs through the in-process engine with real grammars, on a tiny model with
random weights (its free output is noise, so a valid answer is the mask's doing): JSON-schema
answers validate with jsonschema, in batches that mix them with free requests whose greedy
tokens equal a run without the constrained ones, under chunked prefill, preemption, async
scheduling and tensor parallelism."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest

from baton import LLM, SamplingParams
from baton.engine.outputs import RequestOutput
from baton.engine.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}  # compact JSON is the engine's default: with free whitespace a random model pads forever
JSON = StructuredOutputsParams(json=json.dumps(SCHEMA))
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
CHOICES = ("alpha", "beta", "gamma")


def _prompts(n: int, seed: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randint(5, 40))]}
        for _ in range(n)
    ]


FREE = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _constrained_params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=JSON),
        SamplingParams(max_tokens=80, temperature=0.8, seed=7, structured_outputs=JSON),
        SamplingParams(
            max_tokens=20, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=REGEX)
        ),
        SamplingParams(
            max_tokens=20,
            n=2,
            temperature=1.0,
            seed=3,
            structured_outputs=StructuredOutputsParams(choice=CHOICES),
        ),
    ]


def _check_constrained(outputs: list[RequestOutput]) -> None:
    json_a, json_b, regex, choice = outputs
    for out in (json_a, json_b):
        (c,) = out.outputs
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert regex.outputs[0].finish_reason == "stop"
    assert re.fullmatch(REGEX, regex.outputs[0].text), regex.outputs[0].text
    assert len(choice.outputs) == 2
    for c in choice.outputs:
        assert c.finish_reason == "stop" and c.text in CHOICES


def _mixed_run(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    """Free requests alone, then the same free requests interleaved with constrained ones:
    returns both runs' free tokens, after checking every constrained answer."""
    free_prompts = _prompts(4, seed=1)
    alone = [o.outputs[0].token_ids for o in llm.generate(free_prompts, FREE)]
    constrained_prompts = _prompts(4, seed=2)
    prompts, params = [], []
    for i in range(4):
        prompts += [free_prompts[i], constrained_prompts[i]]
        params += [FREE, _constrained_params()[i]]
    outputs = llm.generate(prompts, params)
    _check_constrained(outputs[1::2])
    return alone, [o.outputs[0].token_ids for o in outputs[0::2]]


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 16},
        {"num_gpu_blocks_override": 14},
        {"async_scheduling": True},
    ],
    ids=["plain", "chunked-prefill", "preemption", "async"],
)
def test_constrained_and_free_requests_in_one_batch(tiny_model, engine_args: dict) -> None:
    """Constrained answers are valid and end with "stop"; the free requests' greedy tokens are
    those of a run without the constrained ones."""
    llm = LLM(str(tiny_model("llama")), max_model_len=128, **engine_args)
    alone, mixed = _mixed_run(llm)
    assert mixed == alone
    if "num_gpu_blocks_override" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv.usage() == 0.0


def test_no_grammar_backend_until_a_constrained_request(tiny_model) -> None:
    """An engine never asked for a grammar builds none (no tokenizer load in the core)."""
    llm = LLM(str(tiny_model("llama")), max_model_len=128)
    llm.generate(_prompts(2, seed=3), FREE)
    assert llm.engine.scheduler.structured is None
    llm.generate(_prompts(1, seed=3), _constrained_params()[2])
    assert llm.engine.scheduler.structured is not None


def test_a_grammar_backend_that_cannot_be_built_fails_constrained_requests_only(
    tiny_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend is built on a thread (the busy loop never waits for the tokenizer load); if
    that fails, each constrained request ends with the reason, once tried, and free ones run."""
    llm = LLM(str(tiny_model("llama")), max_model_len=128)

    def broken() -> None:
        raise FileNotFoundError("no tokenizer.json")

    monkeypatch.setattr(llm.engine, "_structured_output_manager", broken)
    free, a, b = llm.generate(_prompts(3, seed=6), [FREE, *_constrained_params()[2:3] * 2])
    assert free.outputs[0].finish_reason == "length"
    for out in (a, b):
        assert out.outputs[0].finish_reason == "error"
        assert "unavailable" in (out.error or "") and "no tokenizer.json" in (out.error or "")
    assert not llm.engine.has_unfinished_requests()


def test_length_cut_min_tokens_and_a_bad_grammar(tiny_model) -> None:
    """max_tokens cuts a constrained answer with "length"; a grammar complete before
    min_tokens ends with "stop" (nothing but EOS could follow, and EOS is blocked); a grammar
    that does not compile ends its request with "error" and the others still finish."""
    llm = LLM(str(tiny_model("llama")), max_model_len=128)
    prompts = _prompts(3, seed=4)
    cut = SamplingParams(max_tokens=3, temperature=0.0, structured_outputs=JSON)
    short = SamplingParams(
        max_tokens=20,
        min_tokens=15,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(choice=CHOICES),
    )
    bad = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex="(["))
    out_cut, out_short, out_bad = llm.generate(prompts, [cut, short, bad])
    assert out_cut.outputs[0].finish_reason == "length"
    assert len(out_cut.outputs[0].token_ids) == 3
    assert out_cut.outputs[0].text.startswith("{")
    assert out_short.outputs[0].finish_reason == "stop"
    assert out_short.outputs[0].text in CHOICES
    assert out_bad.outputs[0].finish_reason == "error" and out_bad.error
    assert not llm.engine.has_unfinished_requests()


def test_a_grammar_too_costly_or_left_no_token_ends_with_a_400(
    tiny_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grammar whose masks cost more than the engine's per-token budget (the budget set to
    nothing here, so any grammar does; a client's ambiguous grammar really costs 50-250 ms a
    token on a 49k vocabulary) ends after MASK_STRIKES masks with an error, a 400, saying why,
    while a free request beside it finishes; so does one whose allowed_token_ids leave its
    grammar no token. Neither is reported as an engine fault."""
    from baton.engine.structured import manager

    llm = LLM(str(tiny_model("llama")), max_model_len=128)
    free, costly, boxed = _prompts(3, seed=5)
    regex = StructuredOutputsParams(regex="[a-z]{40}")
    none_left = SamplingParams(
        max_tokens=10, allowed_token_ids=[100], structured_outputs=StructuredOutputsParams(
            choice=("alpha",)
        )
    )  # fmt: skip
    (out_boxed,) = llm.generate([boxed], none_left)
    assert out_boxed.outputs[0].finish_reason == "error" and out_boxed.error_status == 400
    assert "allowed_token_ids" in (out_boxed.error or "")
    monkeypatch.setattr(manager, "MASK_BUDGET_S", 0.0)
    out_free, out_costly = llm.generate(
        [free, costly], [FREE, SamplingParams(max_tokens=30, structured_outputs=regex)]
    )
    assert out_free.outputs[0].finish_reason == "length"
    assert out_costly.outputs[0].finish_reason == "error" and out_costly.error_status == 400
    assert "ms a token" in (out_costly.error or "")
    assert len(out_costly.outputs[0].token_ids) <= manager.MASK_STRIKES
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.scheduler.structured._get()._requests  # type: ignore[attr-defined]


@pytest.mark.slow
def test_tensor_parallel_masks_every_rank_alike(tiny_model) -> None:
    """With tensor_parallel_size 2 every rank gets the same mask: the answers are valid and
    equal those of one process."""
    path: Path = tiny_model("llama")
    runs = []
    for tp in (1, 2):
        llm = LLM(str(path), max_model_len=128, tensor_parallel_size=tp)
        try:
            prompts = _prompts(4, seed=5)
            outputs = llm.generate(prompts, _constrained_params())
            _check_constrained(outputs)
            runs.append([[c.token_ids for c in o.outputs] for o in outputs])
        finally:
            llm.shutdown()
    assert runs[0] == runs[1]
