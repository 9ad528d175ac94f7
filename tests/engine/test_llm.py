"""End-to-end tests of the offline `LLM` API against transformers, the correctness oracle."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.layers import cpu_linear
from baton.engine.layers.cpu_linear import PackedLinear
from baton.engine.models.config import ModelConfig
from baton.engine.ops import cpu_paged_attention
from tests.engine.oracle import assert_greedy_matches, hf_greedy, hf_model

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "phi3"]
# Shorter than a block, exactly one, one past, several blocks and not aligned.
LENGTHS = [3, 15, 16, 17, 40, 70]


def _prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _check_all(path: Path, prompts: list[list[int]], outputs: list) -> None:
    compared = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt_token_ids == prompt
        compared += assert_greedy_matches(path, prompt, out.outputs[0].token_ids)
    # Near-ties are rare with these models: most tokens must have been compared exactly.
    assert compared >= 0.8 * sum(len(o.outputs[0].token_ids) for o in outputs)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_model, arch: str) -> None:
    """Greedy output equals transformers' greedy generate, for each architecture, on a batch of
    mixed prompt lengths."""
    path = tiny_model(arch)
    llm = LLM(str(path), max_model_len=256)
    prompts = _prompts(LENGTHS, 512)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    _check_all(path, prompts, outputs)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    ("arch", "scaling"),
    [
        ("llama", _LLAMA3),
        ("llama", {"rope_type": "linear", "factor": 4.0}),
        ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ],
    ids=["llama3", "linear", "yarn"],
)
def test_rope_scaling_matches_transformers(tiny_model, arch: str, scaling: dict) -> None:
    """Rope scaling gives the same greedy tokens as transformers, past the original length."""
    path = tiny_model(arch, rope_scaling=scaling)
    llm = LLM(str(path), max_model_len=256)
    prompts = _prompts([20, 90], 512, seed=1)
    _check_all(path, prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy()))


def test_qwen3_with_attention_bias_matches_transformers(tiny_model) -> None:
    """Qwen3's `attention_bias` biases q/k/v and o_proj, as in transformers (Llama's biases,
    MLP ones included, are checked at both tensor-parallel sizes in test_tensor_parallel)."""
    path = tiny_model("qwen3", biases=True)
    llm = LLM(str(path), max_model_len=256)
    prompts = _prompts([5, 40], 512, seed=2)
    _check_all(path, prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy()))


def test_linear_and_yarn_scaling_stretch_the_longest_sequence(tiny_model) -> None:
    """As vLLM derives it: max_position_embeddings (2,048 for the tiny models) times a linear
    factor, YaRN's original length times its factor, llama3's as written; the default
    max_model_len is that, and a longer one is refused naming it."""
    for scaling, longest in [
        ({"rope_type": "linear", "factor": 2.0}, 4096),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}, 1024),
        (_LLAMA3, 2048),
    ]:
        config = ModelConfig.from_pretrained(tiny_model("llama", rope_scaling=scaling))
        assert config.max_positions == longest, scaling
    path = tiny_model("llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="longest sequence, 4096"):
        LLM(str(path), max_model_len=4097)


def test_an_unsupported_rope_scaling_is_a_clear_error(tiny_model) -> None:
    path = tiny_model("llama", rope_scaling={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match="unsupported rope scaling 'longrope'"):
        LLM(str(path), max_model_len=256)


def test_prefix_cache_hits_keep_outputs_exact(tiny_model) -> None:
    """Prompts that hit the prefix cache (shared system prefix, repeated prompts) still equal
    transformers, and the hits are counted."""
    path = tiny_model("llama")
    llm = LLM(str(path), max_model_len=256)
    prefix = _prompts([48], 512, seed=2)[0]
    tails = _prompts([5, 17, 33], 512, seed=3)
    prompts = [prefix + t for t in tails]
    first = llm.generate([{"prompt_token_ids": prompts[0]}], _greedy())
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    assert all(o.num_cached_tokens >= 48 for o in rest)
    assert llm.engine.scheduler.kv.stats.hits >= 48 * 3
    _check_all(path, prompts[:1], first)
    _check_all(path, prompts, rest)
    assert rest[0].outputs[0].token_ids == first[0].outputs[0].token_ids


def test_prefix_caching_can_be_turned_off(tiny_model) -> None:
    """With enable_prefix_caching=False nothing is reused and outputs are unchanged."""
    path = tiny_model("llama")
    llm = LLM(str(path), max_model_len=256, enable_prefix_caching=False)
    prompt = _prompts([40], 512, seed=4)[0]
    a = llm.generate([{"prompt_token_ids": prompt}], _greedy())
    b = llm.generate([{"prompt_token_ids": prompt}], _greedy())
    assert b[0].num_cached_tokens == 0
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_chunked_prefill_matches_transformers(tiny_model) -> None:
    """A small token budget splits prompts into chunks across steps; outputs stay exact."""
    path = tiny_model("qwen3")
    llm = LLM(str(path), max_model_len=256, max_num_batched_tokens=16)
    prompts = _prompts([70, 33, 9], 512, seed=5)
    _check_all(path, prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy()))


def test_preemption_matches_transformers(tiny_model) -> None:
    """Too few KV blocks for all requests at once forces preemption by recompute; outputs stay
    exact."""
    path = tiny_model("llama")
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=12)
    prompts = _prompts([40, 45, 50, 20, 30, 60], 512, seed=6)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(40))
    assert llm.engine.scheduler.num_preemptions > 0
    _check_all(path, prompts, outputs)
    assert llm.engine.scheduler.kv.num_free_blocks == 12


def test_block_count_override_is_taken_as_given(tiny_model) -> None:
    """`num_gpu_blocks_override` sets the cache's size even past what the running sequences
    could fill (the rest holds cached prefixes), as vLLM takes it; a memory budget is capped
    there."""
    path = tiny_model("llama")
    llm = LLM(str(path), max_model_len=128, max_num_seqs=2, num_gpu_blocks_override=40)
    assert llm.engine.num_blocks == 40  # 2 sequences of 8 blocks would have capped it at 16
    budget = LLM(str(path), max_model_len=128, max_num_seqs=2, kv_cache_memory_bytes=1 << 30)
    assert budget.engine.num_blocks == 16


def test_sdpa_decode_path_matches_transformers(tiny_model, monkeypatch) -> None:
    """The torch SDPA decode path (used where the C kernel is unavailable) is exact too."""
    monkeypatch.setattr(cpu_paged_attention, "available", lambda *a: False)
    path = tiny_model("qwen2")
    llm = LLM(str(path), max_model_len=256)
    prompts = _prompts(LENGTHS, 512, seed=7)
    _check_all(path, prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy()))


def test_sharded_safetensors_load(tiny_model, tmp_path: Path) -> None:
    """A model saved in several safetensors shards loads and gives the same tokens."""
    path = tiny_model("mistral")
    sharded = tmp_path / "sharded"
    hf_model(path).save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((path / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    prompt = _prompts([30], 512, seed=8)[0]
    a = LLM(str(path), max_model_len=128).generate([{"prompt_token_ids": prompt}], _greedy())
    b = LLM(str(sharded), max_model_len=128).generate([{"prompt_token_ids": prompt}], _greedy())
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_seeded_sampling_is_batch_independent(tiny_model) -> None:
    """A seeded request samples the same tokens alone and inside a busy batch."""
    path = tiny_model("llama")
    llm = LLM(str(path), max_model_len=256)
    prompt = {"prompt_token_ids": _prompts([12], 512, seed=9)[0]}
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234)
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in _prompts([5, 30, 60], 512, seed=10)]
    params = [SamplingParams(max_tokens=20, temperature=1.0)] * 3 + [seeded]
    together = llm.generate([*others, prompt], params)[3].outputs[0].token_ids
    assert alone == together
    other_seed = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=4321)
    assert llm.generate([prompt], other_seed)[0].outputs[0].token_ids != alone


def test_n_samples_share_prompt_blocks(tiny_model) -> None:
    """n > 1 returns n samples; the later samples reuse the first one's prompt blocks."""
    path = tiny_model("llama")
    llm = LLM(str(path), max_model_len=256)
    prompt = _prompts([50], 512, seed=11)[0]
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.engine.scheduler.kv.stats.hits == 2 * 48  # 3 full blocks, for 2 siblings


def test_logprobs_match_transformers(tiny_model) -> None:
    """Top-n logprobs per generated token equal transformers' log-softmax of its logits."""
    path = tiny_model("llama")
    llm = LLM(str(path), max_model_len=256)
    prompt = _prompts([20], 512, seed=12)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    _, logits = hf_greedy(path, prompt, 6)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and len(out.logprobs) == 6
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert token in entry and entry[token].rank == 1
        top = torch.topk(ref[step], 3).indices.tolist()
        assert set(top) <= set(entry)
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(float(ref[step, tid]), abs=1e-4)
            assert lp.decoded_token is not None
    assert out.cumulative_logprob == pytest.approx(
        sum(entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs, strict=True))
    )


def test_stop_strings_are_cut(tiny_model) -> None:
    """A stop string ends the request with finish_reason 'stop' and is not in the text."""
    path = tiny_model("llama")
    llm = LLM(str(path), max_model_len=256)
    prompt = "hello world, this is"
    free = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    text = free[0].outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]))
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == text[: text.index(stop)]
    assert stop not in completion.text


def test_stop_token_ids_and_min_tokens(tiny_model) -> None:
    """stop_token_ids end a request with 'stop'; min_tokens keeps them from ending it early."""
    path = tiny_model("llama")
    llm = LLM(str(path), max_model_len=256)
    prompt = {"prompt_token_ids": _prompts([10], 512, seed=13)[0]}
    free = llm.generate(prompt, _greedy(12))[0].outputs[0].token_ids
    stop_id = free[4]
    first = free.index(stop_id)
    out = llm.generate(
        prompt,
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]),
    )[0].outputs[0]
    assert out.token_ids == free[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    late = llm.generate(
        prompt,
        SamplingParams(
            max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=12
        ),
    )
    assert len(late[0].outputs[0].token_ids) == 12


def test_min_tokens_forbids_eos_under_ignore_eos_too(tiny_model) -> None:
    """As in vLLM: min_tokens keeps EOS from being sampled before the min_tokens-th token even
    with ignore_eos (which only keeps EOS from ending the request); after it, EOS may come."""
    path = tiny_model("llama")
    llm = LLM(str(path), max_model_len=256)
    eos = json.loads((Path(path) / "config.json").read_text())["eos_token_id"]
    prompt = {"prompt_token_ids": _prompts([10], 512, seed=13)[0]}
    pushed = {"logit_bias": {eos: 100.0}, "max_tokens": 10, "temperature": 0.0}
    out = llm.generate(prompt, SamplingParams(**pushed, ignore_eos=True, min_tokens=5))
    ids = list(out[0].outputs[0].token_ids)
    assert len(ids) == 10 and eos not in ids[:5] and ids[5:] == [eos] * 5
    alone = llm.generate(prompt, SamplingParams(**pushed, ignore_eos=True))[0].outputs[0]
    assert list(alone.token_ids) == [eos] * 10
    stops = llm.generate(prompt, SamplingParams(**pushed, min_tokens=5))[0].outputs[0]
    assert eos not in stops.token_ids[:5] and stops.token_ids[5:] == [eos]
    assert stops.finish_reason == "stop"


def test_text_prompts_and_detokenization(tiny_model) -> None:
    """String prompts are tokenized; the returned text is the tokenizer's decode of the tokens."""
    path = tiny_model("qwen2")
    llm = LLM(str(path), max_model_len=256)
    outputs = llm.generate(["Hi there", "naïve café ünïcode ✓"], _greedy(30))
    tok = llm.get_tokenizer()
    for o in outputs:
        assert o.prompt_token_ids == tok.encode(o.prompt)
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)


def test_chat_uses_template(tiny_model) -> None:
    """LLM.chat renders the conversation through the tokenizer's chat template."""
    path = tiny_model("qwen3")
    llm = LLM(str(path), max_model_len=256)
    messages = [{"role": "user", "content": "What is a baton?"}]
    out = llm.chat(messages, _greedy(5))[0]
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 5


def test_bfloat16_runs(tiny_model) -> None:
    """dtype='bfloat16' loads and generates (bf16 math is not token-exact with fp32)."""
    llm = LLM(str(tiny_model("llama")), max_model_len=128, dtype="bfloat16")
    out = llm.generate("hello", _greedy(5))[0]
    assert len(out.outputs[0].token_ids) == 5
    assert llm.engine.runner.kv_cache is not None
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16


@pytest.mark.parametrize("gemm", ["this CPU's", "widened"])
def test_bfloat16_decodes_agree_with_transformers_in_bfloat16(
    tiny_model, monkeypatch: pytest.MonkeyPatch, gemm: str
) -> None:
    """In bfloat16 (where greedy tokens are not comparable token for token: rounding differs
    between kernels), teacher-forced on the engine's own tokens, each decode's logprob of its
    token is within bfloat16's error of transformers' bfloat16 forward (0.1 to 0.13 at worst
    here, with the C kernel or the torch path alike), and the token is in
    transformers' top 2: the bfloat16 cache read by the C decode kernel (and by the torch path
    where the kernel is missing) computes what transformers computes. `widened`: as on a CPU
    whose oneDNN has no bfloat16 GEMM, every linear computes in float32 over a float32 packing."""
    if gemm == "widened":
        if not cpu_linear.packs(torch.float32):
            pytest.skip("no oneDNN packed linear here")
        monkeypatch.setattr(cpu_linear, "packs", lambda dtype: dtype == torch.float32)
    path = tiny_model("llama")
    llm = LLM(str(path), max_model_len=256, dtype="bfloat16")
    if gemm == "widened":
        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
        assert linears and all(m.compute == torch.float32 for m in linears)
    prompts = _prompts([20, 37, 90], 512, seed=5)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    model = hf_model(path, torch.bfloat16)
    for prompt, out in zip(prompts, outs, strict=True):
        gen = out.outputs[0]
        ids = torch.tensor([prompt + list(gen.token_ids)])
        with torch.inference_mode():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1)
        assert gen.logprobs is not None
        for step, token in enumerate(gen.token_ids):
            assert token in torch.topk(ref[step], 2).indices.tolist(), step
            got = gen.logprobs[step][token].logprob
            assert got == pytest.approx(float(ref[step, token]), abs=0.25), step


def test_bad_input_is_rejected_and_engine_survives(tiny_model) -> None:
    """Bad prompts and parameters raise clear ValueErrors; the engine keeps serving."""
    llm = LLM(str(tiny_model("llama")), max_model_len=64)
    with pytest.raises(ValueError, match="longer than max_model_len 64"):
        llm.generate({"prompt_token_ids": [5] * 65}, _greedy())
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, _greedy())
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", _greedy())
    with pytest.raises(ValueError, match=r"outside \[0, 512\)"):
        llm.generate({"prompt_token_ids": [1, 9999]}, _greedy())
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("hi", SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate(["a", "b"], [_greedy()])
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_bad_model_folders_fail_clearly(tiny_model, tmp_path: Path) -> None:
    """A model folder with missing files or an unknown architecture fails at load, saying what
    is wrong."""
    import json
    import shutil

    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    src = tiny_model("llama")
    no_weights = tmp_path / "no-weights"
    shutil.copytree(src, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(no_weights))
    no_config = tmp_path / "no-config"
    shutil.copytree(src, no_config)
    (no_config / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        LLM(str(no_config))
    unknown = tmp_path / "unknown"
    shutil.copytree(src, unknown)
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (unknown / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM"):
        LLM(str(unknown))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(str(src), max_model_len=10**6)
