"""The sampling surface end to end through the offline `LLM`: logit_bias, allowed_token_ids,
bad words, prompt_logprobs and include_stop_str_in_output, each checked against transformers'
logits of the same sequence (the oracle), with vLLM's documented semantics.

One engine serves the whole module; random tiny weights make greedy output noise, so every
constraint visibly changes it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams
from tests.engine.oracle import NEAR_TIE, hf_model

VOCAB = 512
MAX_BATCHED = 16  # small, so a 40-token prompt is computed in three chunks


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _greedy(max_tokens: int = 16, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model_path(tiny_model) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm(model_path: Path) -> Iterator[LLM]:
    engine = LLM(str(model_path), max_model_len=256, max_num_batched_tokens=MAX_BATCHED)
    yield engine
    engine.shutdown()


def _hf_logits(path: Path, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' logits at every position of prompt + output: row i predicts token i + 1."""
    with torch.inference_mode():
        ids = torch.tensor([prompt + output])
        return hf_model(path)(ids).logits[0].float()


def _assert_greedy_under(
    path: Path,
    prompt: list[int],
    output: list[int],
    adjust: Callable[[int, list[int], torch.Tensor], torch.Tensor],
) -> None:
    """Each output token is the argmax of transformers' logits after `adjust(step, output so
    far, logits)`, up to a near-tie (after which the sequences may legitimately diverge)."""
    logits = _hf_logits(path, prompt, output)
    for step, token in enumerate(output):
        row = adjust(step, output[:step], logits[len(prompt) - 1 + step].clone())
        best = int(row.argmax())
        if token != best:
            gap = float(row[best] - row[token])
            assert gap < NEAR_TIE, f"step {step}: got {token}, oracle {best} (gap {gap:.2e})"
            return


def test_plain_rows_unchanged_beside_constrained_ones(llm: LLM, model_path: Path) -> None:
    """In one batch: a plain greedy row equals its run alone; +100 logit_bias forces its token;
    allowed_token_ids keeps to its set (and is its argmax); -100 on the free pick moves it."""
    prompt = {"prompt_token_ids": _prompt(12, seed=1)}
    free = llm.generate(prompt, _greedy())[0].outputs[0].token_ids
    allowed = [7, 42, 99, 300]
    outs = llm.generate(
        [prompt] * 4,
        [
            _greedy(),
            _greedy(logit_bias={123: 100.0}),
            _greedy(allowed_token_ids=allowed),
            _greedy(logit_bias={free[0]: -100.0}),
        ],
    )
    plain, forced, restricted, banned = (o.outputs[0].token_ids for o in outs)
    assert plain == free
    assert forced == [123] * 16
    assert set(restricted) <= set(allowed) and len(set(restricted)) > 1
    assert banned[0] != free[0]
    ids = prompt["prompt_token_ids"]

    def only_allowed(step: int, past: list[int], row: torch.Tensor) -> torch.Tensor:
        keep = torch.full_like(row, float("-inf"))
        keep[allowed] = row[allowed]
        return keep

    def minus_100(step: int, past: list[int], row: torch.Tensor) -> torch.Tensor:
        row[free[0]] -= 100.0
        return row

    _assert_greedy_under(model_path, ids, restricted, only_allowed)
    _assert_greedy_under(model_path, ids, banned, minus_100)


def test_bad_words(llm: LLM, model_path: Path) -> None:
    """A one-token bad word never appears; a two-token word's second token is forbidden only
    right after its first (vLLM: the output so far ends with the word's other tokens)."""
    ids = _prompt(10, seed=2)
    prompt = {"prompt_token_ids": ids}
    free = llm.generate(prompt, _greedy(24))[0].outputs[0].token_ids
    common = max(set(free), key=free.count)
    single = llm.generate(prompt, _greedy(24, bad_words_token_ids=[[common]]))[0].outputs[0]
    assert common not in single.token_ids

    def ban(step: int, past: list[int], row: torch.Tensor) -> torch.Tensor:
        row[common] = float("-inf")
        return row

    _assert_greedy_under(model_path, ids, single.token_ids, ban)

    first, second = free[3], free[4]
    word = [first, second]
    pair = llm.generate(prompt, _greedy(24, bad_words_token_ids=[word]))[0].outputs[0].token_ids
    assert pair[:4] == free[:4] and pair[4] != second
    assert all(pair[i : i + 2] != word for i in range(len(pair) - 1))

    def ban_after_first(step: int, past: list[int], row: torch.Tensor) -> torch.Tensor:
        if past and past[-1] == first:
            row[second] = float("-inf")
        return row

    _assert_greedy_under(model_path, ids, pair, ban_after_first)


def test_bad_words_and_prompt_logprobs_with_async_scheduling(model_path: Path) -> None:
    """Under async scheduling the last token is still on the device when the next step is
    built; a two-token bad word must still see it (the runner waits for it), and prompt
    logprobs read later from the step's pending output equal transformers'."""
    ids = _prompt(10, seed=2)
    engine = LLM(
        str(model_path), max_model_len=128, async_scheduling=True, max_num_batched_tokens=16
    )
    long_ids = _prompt(40, seed=3)
    try:
        free = engine.generate({"prompt_token_ids": ids}, _greedy(24))[0].outputs[0].token_ids
        word = [free[3], free[4]]
        params = _greedy(24, bad_words_token_ids=[word])
        out = engine.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
        long_params = _greedy(4, prompt_logprobs=2)
        lps = engine.generate({"prompt_token_ids": long_ids}, long_params)[0].prompt_logprobs
    finally:
        engine.shutdown()
    assert out[:4] == free[:4] and out[4] != word[1]
    assert all(out[i : i + 2] != word for i in range(len(out) - 1))
    ref = torch.log_softmax(_hf_logits(model_path, long_ids, []), dim=-1)
    assert lps is not None and len(lps) == 40
    for pos, entry in enumerate(lps[1:], start=1):
        assert entry is not None and long_ids[pos] in entry
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(float(ref[pos - 1, tid]), abs=1e-4)


def test_prompt_logprobs_match_transformers_across_chunks(llm: LLM, model_path: Path) -> None:
    """A 40-token prompt, computed in chunks of 16: every position after the first carries the
    prompt token's logprob and rank plus the top 3, equal to transformers' log_softmax; the
    same prompt again gets no prefix-cache hit (vLLM skips the cache for it) and equal values."""
    ids = _prompt(40, seed=3)
    params = _greedy(4, prompt_logprobs=3)
    first = llm.generate({"prompt_token_ids": ids}, params)[0]
    again = llm.generate({"prompt_token_ids": ids}, params)[0]
    ref = torch.log_softmax(_hf_logits(model_path, ids, []), dim=-1)  # row i predicts i + 1
    for out in (first, again):
        lps = out.prompt_logprobs
        assert lps is not None and len(lps) == len(ids) and lps[0] is None
        for pos in range(1, len(ids)):
            entry = lps[pos]
            assert entry is not None
            row = ref[pos - 1]
            token = ids[pos]
            assert token in entry
            assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
            top = row.topk(3).indices.tolist()
            assert set(top) <= set(entry) and len(entry) <= 4
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(float(row[tid]), abs=1e-4)
    assert again.num_cached_tokens == 0
    # A request without prompt_logprobs gets neither them nor a changed output.
    plain = llm.generate({"prompt_token_ids": ids}, _greedy(4))[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == first.outputs[0].token_ids
    assert plain.num_cached_tokens > 0


def test_prompt_logprobs_zero_and_one_token_prompt(llm: LLM) -> None:
    """prompt_logprobs=0: only the prompt's own token per position; a one-token prompt: [None]."""
    ids = _prompt(5, seed=4)
    out = llm.generate({"prompt_token_ids": ids}, _greedy(2, prompt_logprobs=0))[0]
    assert out.prompt_logprobs is not None
    assert [list(e) if e else None for e in out.prompt_logprobs] == [None] + [[t] for t in ids[1:]]
    one = llm.generate({"prompt_token_ids": ids[:1]}, _greedy(2, prompt_logprobs=2))[0]
    assert one.prompt_logprobs == [None]


def test_include_stop_str_in_output(llm: LLM) -> None:
    """vLLM: with include_stop_str_in_output the stop string stays at the end of the text (the
    stop_reason is still the string); a stop token's text is left out unless it is set."""
    prompt = "hello world, this is"
    free = llm.generate(prompt, _greedy(30)).pop().outputs[0]
    stop = free.text[3:6]
    cut = free.text.index(stop)
    for include, text in ((False, free.text[:cut]), (True, free.text[: cut + len(stop)])):
        params = SamplingParams(
            max_tokens=30, temperature=0.0, stop=[stop], include_stop_str_in_output=include
        )
        out = llm.generate(prompt, params)[0].outputs[0]
        assert (out.text, out.finish_reason, out.stop_reason) == (text, "stop", stop)

    tok = llm.get_tokenizer()
    stop_id = free.token_ids[5]
    end = free.token_ids.index(stop_id) + 1
    for include in (False, True):
        params = _greedy(30, stop_token_ids=[stop_id], include_stop_str_in_output=include)
        out = llm.generate(prompt, params)[0].outputs[0]
        assert out.token_ids == free.token_ids[:end] and out.stop_reason == stop_id
        shown = free.token_ids[:end] if include else free.token_ids[: end - 1]
        assert out.text == tok.decode(shown)


def test_out_of_vocab_ids_are_rejected_before_queueing(llm: LLM) -> None:
    """Token ids past the vocab in logit_bias, allowed_token_ids or bad words fail the call with
    a ValueError naming the field (as vLLM's processor does); the engine keeps serving."""
    prompt = {"prompt_token_ids": [5, 6, 7]}
    cases = [
        ("logit_bias", _greedy(logit_bias={VOCAB: 1.0})),
        ("allowed_token_ids", _greedy(allowed_token_ids=[1, VOCAB + 3])),
        ("bad_words_token_ids", _greedy(bad_words_token_ids=[[1, VOCAB]])),
    ]
    for name, params in cases:
        with pytest.raises(ValueError, match=rf"prompt 0: {name} has token ids outside"):
            llm.generate(prompt, params)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(prompt, _greedy(3))[0].outputs[0].token_ids) == 3


def test_prompt_logprobs_survive_preemption(model_path: Path) -> None:
    """Too few KV blocks: requests are preempted (some mid-prompt, in chunks of 16) and
    recomputed; each one's prompt logprobs still cover every position once, equal to
    transformers', and its output equals a run without prompt_logprobs."""
    prompts = [_prompt(n, seed=10 + n) for n in (40, 45, 50, 20, 30, 60)]
    engine = LLM(
        str(model_path), max_model_len=128, num_gpu_blocks_override=12, max_num_batched_tokens=16
    )
    try:
        inputs = [{"prompt_token_ids": p} for p in prompts]
        outs = engine.generate(inputs, _greedy(30, prompt_logprobs=1))
        assert engine.engine.scheduler.num_preemptions > 0
        plain = engine.generate(inputs, _greedy(30))
    finally:
        engine.shutdown()
    for ids, out, ref_out in zip(prompts, outs, plain, strict=True):
        assert out.outputs[0].token_ids == ref_out.outputs[0].token_ids
        ref = torch.log_softmax(_hf_logits(model_path, ids, []), dim=-1)
        lps = out.prompt_logprobs
        assert lps is not None and len(lps) == len(ids)
        for pos in range(1, len(ids)):
            entry = lps[pos]
            assert entry is not None
            assert entry[ids[pos]].logprob == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-4)
