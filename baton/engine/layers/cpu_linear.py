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

import torch
from torch import nn


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a weight packed for oneDNN; no trainable parameters."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN packed"


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs a packed linear of `dtype` here and agrees with `F.linear`."""
    if not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=generator).to(dtype)
    linear = nn.Linear(16, 8).to(dtype)
    try:
        got = PackedLinear(linear)(x)
    except RuntimeError:  # e.g. float16 without the CPU support oneDNN asks for
        return False
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    return torch.allclose(got.float(), linear(x).float(), atol=tolerance, rtol=tolerance)


def pack_linears(model: nn.Module) -> int:
    """Replaces every CPU `nn.Linear` of `model` whose dtype oneDNN packs with a `PackedLinear`;
    returns how many were replaced."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and child.weight.device.type == "cpu"
        and packs(child.weight.dtype)
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
