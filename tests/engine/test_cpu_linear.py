"""oneDNN linears with packed weights (`baton.engine.layers.cpu_linear`): the same answers as
`nn.Linear`, every projection of a CPU engine's model packed, tied embeddings kept."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from baton import LLM, SamplingParams
from baton.engine.layers import cpu_linear
from baton.engine.layers.cpu_linear import PackedLinear, pack_linears, packs
from baton.engine.models.config import ModelConfig
from baton.engine.models.loader import load_model
from tests.engine.oracle import assert_greedy_matches

pytestmark = pytest.mark.skipif(
    not packs(torch.float32), reason="this torch has no oneDNN packed linear on this CPU"
)


def _packed(linear: nn.Linear) -> PackedLinear:
    return PackedLinear(linear.weight, linear.bias)


def _linear(k: int, n: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(k, n, bias=bias).to(dtype)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
def test_bfloat16_is_bit_identical_to_linear(rows: int, bias: bool) -> None:
    if not packs(torch.bfloat16):
        pytest.skip("oneDNN runs no bfloat16 linear on this CPU")
    linear = _linear(96, 200, bias, torch.bfloat16)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(_packed(linear)(x), linear(x))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
def test_float32_equals_linear_up_to_rounding(rows: int, bias: bool) -> None:
    linear = _linear(576, 960, bias, torch.float32)
    x = torch.randn(rows, 576)
    with torch.inference_mode():
        got, want = _packed(linear)(x), linear(x)
    assert got.shape == want.shape == (rows, 960)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
def test_a_widened_16bit_layer_is_the_float32_product_rounded(
    rows: int, dtype: torch.dtype
) -> None:
    """Packed in float32, a 16-bit layer takes and gives its own dtype, and its answer is the
    exact float32 product of the (exactly widened) operands rounded once: within one 16-bit
    rounding of it, and of `F.linear`'s own 16-bit GEMM."""
    linear = _linear(576, 960, True, dtype)
    x = torch.randn(rows, 576).to(dtype)
    packed = PackedLinear(linear.weight, linear.bias, torch.float32)
    with torch.inference_mode():
        got = packed(x)
        exact = F.linear(x.double(), linear.weight.double(), linear.bias.double())
        want = linear(x)
    assert got.dtype == dtype and got.shape == (rows, 960)
    assert packed.packed.dtype == torch.float32
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(got.double(), exact, rtol=ulp, atol=ulp)
    torch.testing.assert_close(got, want, rtol=2 * ulp, atol=2 * ulp)


def test_a_cpu_without_16bit_gemm_packs_those_layers_widened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where oneDNN runs float32 only, bfloat16 and float16 layers are packed in float32 rather
    than left to torch's generic 16-bit GEMM; a float32 one is packed as it is."""
    monkeypatch.setattr(cpu_linear, "packs", lambda dtype: dtype == torch.float32)
    assert cpu_linear.compute_dtype(torch.bfloat16) == torch.float32
    assert cpu_linear.compute_dtype(torch.float16) == torch.float32
    assert cpu_linear.compute_dtype(torch.float64) is None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96).bfloat16(), nn.Linear(96, 32).half(), nn.Linear(32, 8))
    reference = [(m.weight.clone(), m.bias.clone()) for m in model]
    assert pack_linears(model) == 3
    assert [m.compute for m in model] == [torch.float32] * 3
    x = torch.randn(5, 64).bfloat16()
    with torch.inference_mode():
        hidden = model[0](x)
        assert hidden.dtype == torch.bfloat16
        out = model[2](model[1](hidden.half()).float())
    want = F.linear(x.float(), reference[0][0].float(), reference[0][1].float()).bfloat16()
    want = F.linear(want.half().float(), reference[1][0].float(), reference[1][1].float()).half()
    want = F.linear(want.float(), *reference[2])
    torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)


def test_a_torch_without_onednn_leaves_every_layer_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_linear, "packs", lambda dtype: False)
    model = nn.Sequential(nn.Linear(8, 8).bfloat16(), nn.Linear(8, 8))
    assert pack_linears(model) == 0
    assert [type(m) for m in model] == [nn.Linear, nn.Linear]


def test_any_leading_shape_and_strided_input() -> None:
    linear = _linear(32, 48, True, torch.float32)
    packed = _packed(linear)
    x3 = torch.randn(2, 5, 32)
    strided = torch.randn(32, 9).t()  # [9, 32], not contiguous
    with torch.inference_mode():
        torch.testing.assert_close(packed(x3), linear(x3))
        torch.testing.assert_close(packed(strided), linear(strided))


def test_the_engine_model_is_packed_and_keeps_its_tied_embedding(tiny_model) -> None:
    path = tiny_model("llama")
    config = ModelConfig.from_pretrained(path)
    model = load_model(config, torch.float32, torch.device("cpu"), 64)
    reference = load_model(config, torch.float32, torch.device("cpu"), 64)
    embedding = model.embed_tokens.weight
    dense_bytes = sum(p.numel() for p in model.parameters())
    replaced = pack_linears(model)
    # q/k/v, o, gate/up and down per layer, and the lm_head
    assert replaced == 4 * config.num_layers + 1
    assert not [m for m in model.modules() if type(m) is nn.Linear]
    assert model.embed_tokens.weight is embedding  # the embedding still looks rows up
    left = sum(p.numel() for p in model.parameters())
    assert left < dense_bytes / 2  # the projections' dense weights are released
    ids = torch.tensor([1, 5, 9, 200, 3])
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(
            model.compute_logits(x), reference.compute_logits(x), rtol=1e-4, atol=1e-4
        )
        for mine, theirs in zip(model.layers, reference.layers, strict=True):
            torch.testing.assert_close(mine.mlp(x), theirs.mlp(x), rtol=1e-4, atol=1e-4)
    assert model.embed_tokens(ids).shape == (5, config.hidden_size)


def test_a_dtype_oneDNN_cannot_run_stays_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_linear, "packs", lambda dtype: dtype == torch.float32)
    model = nn.Sequential(nn.Linear(8, 8).double(), nn.Linear(8, 8))
    assert pack_linears(model) == 1  # float64 is neither run nor widened
    assert type(model[0]) is nn.Linear and type(model[1]) is PackedLinear


def test_each_dense_weight_is_released_as_its_layer_is_packed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Never every weight in both forms at once: a layer's dense weight is gone before the next
    layer is packed."""
    model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(4)))
    refs = [weakref.ref(m.weight) for m in model]
    alive = []

    class Counting(PackedLinear):
        def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *args) -> None:
            super().__init__(weight, bias, *args)
            alive.append(sum(r() is not None for r in refs))

    monkeypatch.setattr(cpu_linear, "PackedLinear", Counting)
    assert pack_linears(model) == 4
    assert alive == [4, 3, 2, 1]
    assert all(r() is None for r in refs)


def test_a_layer_oneDNN_refuses_stays_dense_and_the_rest_are_packed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Refusing(PackedLinear):
        def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *args) -> None:
            if weight.shape[0] == 24:
                raise RuntimeError("no primitive for this shape")
            super().__init__(weight, bias, *args)

    monkeypatch.setattr(cpu_linear, "PackedLinear", Refusing)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 24), nn.Linear(24, 8))
    reference = [(m.weight.clone(), m.bias.clone()) for m in model]
    assert pack_linears(model) == 2
    assert [type(m) for m in model] == [Refusing, nn.Linear, Refusing]
    x = torch.randn(5, 8)
    want = x
    for weight, bias in reference:
        want = F.linear(want, weight, bias)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)


def test_probing_leaves_torchs_global_seed_alone() -> None:
    packs.cache_clear()
    state = torch.get_rng_state()
    assert packs(torch.float32)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_cpu_engine_runs_packed_and_equals_transformers(tiny_model) -> None:
    path = tiny_model("qwen2")  # q/k/v with bias
    llm = LLM(str(path), max_model_len=256)
    try:
        runner_model = llm.engine.runner.model
        assert not [m for m in runner_model.modules() if type(m) is nn.Linear]
        prompts = [[3, 17, 99, 4, 250], list(range(40, 90))]
        greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
        for prompt, out in zip(prompts, outputs, strict=True):
            assert_greedy_matches(path, prompt, out.outputs[0].token_ids)
    finally:
        llm.shutdown()
