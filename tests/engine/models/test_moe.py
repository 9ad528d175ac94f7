"""Mixture-of-experts models (Mixtral, Qwen3-MoE) against transformers, and the MoE layer's parts:
routing, the grouped CPU expert computation, checkpoint layouts and tensor-parallel shards."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from baton import LLM, SamplingParams
from baton.engine.models.config import ModelConfig
from baton.engine.models.loader import load_model
from baton.engine.models.moe import SparseMoeBlock, fused_experts, select_experts
from baton.engine.models.tensor_parallel import ShardLayout
from baton.engine.models.tiny import MOE_ARCHITECTURES
from tests.engine.oracle import assert_greedy_matches, hf_model

ARCHS = list(MOE_ARCHITECTURES)
LENGTHS = [3, 15, 16, 17, 40, 70]  # under a block, one, one past, several and not aligned


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(max_tokens))
    return [o.outputs[0].token_ids for o in outputs]


def _check_all(path: Path, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    compared = sum(assert_greedy_matches(path, p, o) for p, o in zip(prompts, outputs, strict=True))
    # Near-ties are rare with these models: most tokens must have been compared exactly.
    assert compared >= 0.8 * sum(len(o) for o in outputs)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_model, arch: str) -> None:
    """Greedy output equals transformers' on a batch of mixed prompt lengths."""
    path = tiny_model(arch)
    prompts = _prompts(LENGTHS)
    _check_all(path, prompts, _generate(LLM(str(path), max_model_len=256), prompts))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_hits_and_chunked_prefill_match_transformers(tiny_model, arch: str) -> None:
    """Prompts sharing a 48-token prefix hit the cache, and a 16-token budget chunks prompts over
    steps; outputs still equal transformers'."""
    path = tiny_model(arch)
    llm = LLM(str(path), max_model_len=256, max_num_batched_tokens=16)
    prefix = _prompts([48], seed=2)[0]
    prompts = [prefix + t for t in _prompts([5, 17, 33], seed=3)]
    first = _generate(llm, prompts[:1])
    hits_before = llm.engine.scheduler.kv.stats.hits
    rest = _generate(llm, prompts)
    assert llm.engine.scheduler.kv.stats.hits - hits_before >= 48 * 3
    assert rest[0] == first[0]
    _check_all(path, prompts, rest)


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_matches_transformers(tiny_model, arch: str) -> None:
    """Too few KV blocks for every request at once forces preemption; outputs stay exact."""
    path = tiny_model(arch)
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=12)
    prompts = _prompts([40, 45, 50, 20, 30, 60], seed=6)
    outputs = _generate(llm, prompts, 40)
    assert llm.engine.scheduler.num_preemptions > 0
    _check_all(path, prompts, outputs)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_greedy_equals_tp1_and_transformers(tiny_model, arch: str) -> None:
    """tensor_parallel_size 2 (each rank half of every expert, the router whole) gives the same
    greedy tokens as one process and as transformers."""
    path = tiny_model(arch)
    prompts = _prompts([3, 17, 40], seed=1)
    tp1 = _generate(LLM(str(path), max_model_len=256), prompts, 12)
    llm = LLM(str(path), max_model_len=256, tensor_parallel_size=2)
    try:
        tp2 = _generate(llm, prompts, 12)
    finally:
        llm.shutdown()
    assert tp2 == tp1
    for prompt, tokens in zip(prompts, tp2, strict=True):
        assert assert_greedy_matches(path, prompt, tokens) == len(tokens)


def _naive_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            expert = int(ids[t, slot])
            gate, up = (gate_up[expert] @ x[t]).chunk(2)
            out[t] += weights[t, slot] * (down[expert] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k"), [(1, 4, 2), (37, 8, 2), (64, 16, 4), (9, 4, 1)]
)
def test_grouped_cpu_experts_equal_naive_reference(
    num_tokens: int, num_experts: int, top_k: int
) -> None:
    """The grouped CPU path (pairs sorted by expert, one matmul pair per expert) equals a
    per-token, per-expert loop, including experts no token chose."""
    gen = torch.Generator().manual_seed(num_tokens)
    hidden, inter = 32, 24
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen), top_k, True)
    out = fused_experts(x, gate_up, down, weights, ids)
    torch.testing.assert_close(out, _naive_experts(x, gate_up, down, weights, ids))


def test_routing_normalises_as_each_family_does() -> None:
    """Softmax then top-k; the top-k weights sum to 1 only when renormalised, and keep the
    softmax's values otherwise."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 0.0, 1.0]])
    probs = torch.softmax(logits, -1)
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 1], [1, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    renormed, same_ids = select_experts(logits, 2, renormalize=True)
    assert torch.equal(same_ids, ids)
    torch.testing.assert_close(renormed, weights / weights.sum(-1, keepdim=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_layers_equal_transformers_layers(tiny_model, arch: str) -> None:
    """Each loaded layer's MLP (MoE or dense) equals transformers' on the same inputs."""
    path = tiny_model(arch)
    config = ModelConfig.from_pretrained(path)
    ours = load_model(config, torch.float32, torch.device("cpu"), 64)
    theirs = hf_model(path)
    x = torch.randn(50, config.hidden_size, generator=torch.Generator().manual_seed(0))
    kinds = []
    with torch.inference_mode():
        for mine, ref in zip(ours.layers, theirs.model.layers, strict=True):
            kinds.append(isinstance(mine.mlp, SparseMoeBlock))
            expected = ref.mlp(x.unsqueeze(0))[0]
            torch.testing.assert_close(mine.mlp(x), expected, atol=1e-5, rtol=1e-5)
    assert kinds == ([True, True] if arch == "mixtral" else [False, True])


def test_stacked_checkpoint_loads_like_per_expert(tiny_model, tmp_path: Path) -> None:
    """A checkpoint with transformers 5's stacked expert tensors (`experts.gate_up_proj`) loads
    and gives the per-expert checkpoint's tokens."""
    path = tiny_model("qwen3_moe")
    stacked = tmp_path / "stacked"
    shutil.copytree(path, stacked)
    state = {k: v.contiguous() for k, v in hf_model(path).state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    (stacked / "model.safetensors").unlink()
    save_file(state, str(stacked / "model.safetensors"), metadata={"format": "pt"})
    prompts = _prompts([30, 7], seed=8)
    a = _generate(LLM(str(path), max_model_len=128), prompts, 12)
    assert _generate(LLM(str(stacked), max_model_len=128), prompts, 12) == a


def test_expert_shards_agree_across_checkpoint_layouts(tiny_model) -> None:
    """Under tp 2 a rank's slice of stacked expert tensors equals its slices of the per-expert
    ones: gate and up rows (both halves), down columns; the router stays whole."""
    config = ModelConfig.from_pretrained(tiny_model("mixtral"))
    inter, hidden = config.moe_intermediate_size, config.hidden_size
    gen = torch.Generator().manual_seed(0)
    w1, w3 = torch.randn(2, 4, inter, hidden, generator=gen)
    w2 = torch.randn(4, hidden, inter, generator=gen)
    for rank in range(2):
        layout = ShardLayout.build(config, rank, 2)
        assert layout.moe_intermediate_size == inter // 2
        half = slice(rank * inter // 2, (rank + 1) * inter // 2)
        p = "layers.0.mlp.experts"
        stacked = layout.shard(f"{p}.gate_up_proj", torch.cat((w1, w3), dim=1), 16)
        assert torch.equal(stacked, torch.cat((w1[:, half], w3[:, half]), dim=1))
        assert torch.equal(layout.shard(f"{p}.down_proj", w2, 16), w2[:, :, half])
        for e in range(4):
            assert torch.equal(layout.shard(f"{p}.{e}.w1.weight", w1[e], 16), w1[e, half])
            assert torch.equal(layout.shard(f"{p}.{e}.w3.weight", w3[e], 16), w3[e, half])
            assert torch.equal(layout.shard(f"{p}.{e}.w2.weight", w2[e], 16), w2[e][:, half])
        router = torch.randn(4, hidden, generator=gen)
        assert torch.equal(layout.shard("layers.0.mlp.gate.weight", router, 16), router)


def _config_with(tiny_model, tmp_path: Path, arch: str, **changes: object) -> ModelConfig:
    folder = tmp_path / arch
    shutil.copytree(tiny_model(arch), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return ModelConfig.from_pretrained(folder)


@pytest.mark.parametrize(
    ("changes", "moe_layers"),
    [
        ({"mlp_only_layers": [], "num_hidden_layers": 4}, (0, 1, 2, 3)),
        ({"mlp_only_layers": [], "decoder_sparse_step": 2, "num_hidden_layers": 4}, (1, 3)),
        ({"mlp_only_layers": [3], "decoder_sparse_step": 1, "num_hidden_layers": 4}, (0, 1, 2)),
        ({"num_experts": 0}, ()),
    ],
)
def test_qwen3_moe_sparse_layers_follow_the_config(
    tiny_model, tmp_path: Path, changes: dict[str, object], moe_layers: tuple[int, ...]
) -> None:
    """decoder_sparse_step and mlp_only_layers pick the MoE layers as transformers does."""
    config = _config_with(tiny_model, tmp_path, "qwen3_moe", **changes)
    assert config.moe_layers == moe_layers
    assert config.qk_norm and not config.norm_topk_prob and config.sliding_window is None


def test_mixtral_config_and_uneven_split(tiny_model, tmp_path: Path) -> None:
    """Mixtral: every layer sparse, top-k renormalised, the expert width from intermediate_size;
    a tensor-parallel size that does not divide an expert's width is refused."""
    config = ModelConfig.from_pretrained(tiny_model("mixtral"))
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert config.norm_topk_prob and config.moe_layers == (0, 1)
    assert config.moe_intermediate_size == config.intermediate_size == 64
    odd = _config_with(tiny_model, tmp_path, "qwen3_moe", moe_intermediate_size=66)
    with pytest.raises(ValueError, match="moe_intermediate_size 66"):
        ShardLayout.build(odd, 0, 4)
