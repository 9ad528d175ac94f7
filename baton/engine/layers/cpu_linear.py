"""Linear layers on CPU through oneDNN, each weight packed once at load.

`torch.nn.functional.linear` on CPU runs float32 through MKL's `sgemm`, which lays the weight
out in its blocked format again on every call; at a decode batch that repacking is most of a
projection's time (SmolLM2's 576 x 49,152 `lm_head` at 32 rows: 30 ms, against 10 ms packed).
vLLM's CPU build packs every linear weight once into oneDNN's layout and calls oneDNN's matmul
(`dispatch_cpu_unquantized_gemm`); `pack_linears` does the same through torch's own oneDNN ops.
bfloat16 results are bit-identical to `F.linear`'s (which already calls oneDNN, unpacked);
float32 ones differ in rounding only (another summation order), as any other GEMM's would.

The dense weight is released, except where another module shares it (a tied `lm_head`: the
embedding still looks rows up in it). Where oneDNN cannot run a dtype (float16 without
AVX512-FP16, or a torch without oneDNN), the layer stays `nn.Linear`.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a weight packed for oneDNN; no trainable parameters."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape  # [out, in], as nn.Linear's
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN packed"


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs a packed linear of `dtype` here and agrees with `F.linear`."""
    if not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)  # not torch's global one: a start changes no seed
    x, weight, bias = (
        torch.randn(shape, generator=generator).to(dtype) for shape in ((3, 16), (8, 16), (8,))
    )
    try:
        got = PackedLinear(weight, bias)(x)
    except RuntimeError:  # e.g. float16 without the CPU support oneDNN asks for
        return False
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    want = F.linear(x, weight, bias)
    return torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance)


def pack_linears(model: nn.Module) -> int:
    """Replaces every CPU `nn.Linear` of `model` whose dtype oneDNN packs with a `PackedLinear`;
    returns how many were replaced. Each dense weight is released as its layer is packed, so
    memory never holds both forms of every weight at once. A layer oneDNN refuses to pack stays
    `nn.Linear` (logged), as vLLM's CPU build falls back: the engine starts either way."""
    targets = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and child.weight.device.type == "cpu"
        and packs(child.weight.dtype)
    ]
    packed = len(targets)
    for parent, name in targets:  # (parent, name): `targets` holds no weight alive
        linear = getattr(parent, name)
        try:
            setattr(parent, name, PackedLinear(linear.weight, linear.bias))
        except RuntimeError as e:
            logger.warning("oneDNN cannot pack %s (%s); it stays torch's linear", linear, e)
            packed -= 1
    return packed
