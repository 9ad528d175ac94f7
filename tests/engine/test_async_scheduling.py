"""Async scheduling (step N+1 scheduled while step N runs) gives the same outputs as the
synchronous loop."""

from __future__ import annotations

import random

import pytest

from baton import LLM, SamplingParams


def _workload(seed: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts, params = [], []
    shared = [rng.randrange(3, 512) for _ in range(40)]
    for i in range(10):
        tail = [rng.randrange(3, 512) for _ in range(rng.randint(1, 60))]
        prompts.append({"prompt_token_ids": (shared if i % 3 == 0 else []) + tail})
        kind = i % 5
        if kind == 0:
            p = SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0, ignore_eos=True)
        elif kind == 1:  # greedy, stops on a token it is likely to produce
            p = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[tail[0]])
        elif kind == 2:  # seeded sampling with penalties (host-side token history)
            p = SamplingParams(
                max_tokens=25,
                temperature=0.8,
                seed=i,
                presence_penalty=0.5,
                repetition_penalty=1.2,
                ignore_eos=True,
            )
        elif kind == 3:
            p = SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, min_tokens=5)
        else:
            p = SamplingParams(n=2, max_tokens=15, temperature=1.0, seed=100 + i, top_k=20)
        params.append(p)
    return prompts, params


def _run(model: str, async_scheduling: bool, **kwargs: object) -> list:
    llm = LLM(model, max_model_len=128, async_scheduling=async_scheduling, **kwargs)
    prompts, params = _workload(0)
    outputs = llm.generate(prompts, params)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv.usage() == 0.0
    return [
        [
            (c.token_ids, c.finish_reason, c.logprobs and [sorted(d) for d in c.logprobs])
            for c in o.outputs
        ]
        for o in outputs
    ]


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"max_num_batched_tokens": 24}, {"num_gpu_blocks_override": 14}],
    ids=["plain", "chunked-prefill", "preemption"],
)
def test_async_outputs_equal_sync(tiny_model, engine_args: dict) -> None:
    """Greedy, seeded, penalised, logprob and n>1 requests give identical tokens with and
    without async scheduling, also under chunked prefill and preemption."""
    model = str(tiny_model("llama"))
    assert _run(model, True, **engine_args) == _run(model, False, **engine_args)
