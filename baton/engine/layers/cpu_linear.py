"""Linear layers on CPU through oneDNN, each weight packed once at load.

`torch.nn.functional.linear` on CPU runs float32 through MKL's `sgemm`, which lays the weight
out in its blocked format again on every call; at a decode batch that repacking is most of a
projection's time (SmolLM2's 576 x 49,152 `lm_head` at 32 rows: 30 ms, against 10 ms packed).
vLLM's CPU build packs every linear weight once into oneDNN's layout and calls oneDNN's matmul
(`dispatch_cpu_unquantized_gemm`); `pack_linears` does the same through torch's own oneDNN ops.
bfloat16 results are bit-identical to `F.linear`'s (which already calls oneDNN, unpacked);
float32 ones differ in rounding only (another summation order), as any other GEMM's would.

A CPU without bfloat16 (or float16) arithmetic in oneDNN (x86 with AVX2 but neither AVX-512 nor
AVX-NE-CONVERT, e.g. AMD EPYC before Zen 4) leaves torch a generic 16-bit GEMM: 16 GFLOP/s on two
cores whatever the batch, 3-8x slower than packed float32 from 8 rows up (`bench/matmul.py`).
There a 16-bit layer is packed *widened*: its weight is stored packed in float32 (twice the
16-bit bytes; activations and the KV cache stay 16-bit), each input widened, the float32 product
rounded back. Widening is exact, and the 16-bit GEMM accumulates in float32 too, so the result
differs from `F.linear`'s in summation order only. The price is at one row, a lone stream's
decode, where reading twice the bytes makes most projections 0.65-0.8x as fast.

The dense weight is released, except where another module shares it (a tied `lm_head`: the
embedding still looks rows up in it). Where oneDNN cannot run a dtype even widened (a torch
without oneDNN), the layer stays `nn.Linear`.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

_WIDENS = (torch.bfloat16, torch.float16)  # exactly representable in float32


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a weight packed for oneDNN in `compute` (by default the
    weight's own dtype); no trainable parameters."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, compute: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape  # [out, in], as nn.Linear's
        self.dtype = weight.dtype  # what callers pass in and get back
        self.compute = compute or weight.dtype
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(self.compute))
        self.bias = None if bias is None else bias.detach().to(self.compute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.dtype == self.compute:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        wide = x.to(self.compute)
        out = torch.ops.mkldnn._linear_pointwise(wide, self.packed, self.bias, "none", [], "")
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        widened = "" if self.compute == self.dtype else f", computed in {self.compute}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"oneDNN packed{widened}"
        )


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs a packed linear of `dtype` here, in `dtype`, and agrees with
    `F.linear`."""
    if not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)  # not torch's global one: a start changes no seed
    x, weight, bias = (
        torch.randn(shape, generator=generator).to(dtype) for shape in ((3, 16), (8, 16), (8,))
    )
    try:
        got = PackedLinear(weight, bias)(x)
    except RuntimeError:  # e.g. bfloat16 on a CPU with neither AVX-512 nor AVX-NE-CONVERT
        return False
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    want = F.linear(x, weight, bias)
    return torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance)


def compute_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a packed linear of `dtype` computes in here: `dtype` itself where oneDNN runs
    it, float32 for a 16-bit dtype it does not (widened), None where neither packs."""
    if packs(dtype):
        return dtype
    if dtype in _WIDENS and packs(torch.float32):
        return torch.float32
    return None


def pack_linears(model: nn.Module) -> int:
    """Replaces every CPU `nn.Linear` of `model` whose dtype oneDNN packs (natively or widened)
    with a `PackedLinear`; returns how many were replaced. Each dense weight is released as its
    layer is packed, so memory never holds both forms of every weight at once. A layer oneDNN
    refuses to pack stays `nn.Linear` (logged), as vLLM's CPU build falls back: the engine
    starts either way."""
    targets = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and child.weight.device.type == "cpu"
        and compute_dtype(child.weight.dtype) is not None
    ]
    packed = len(targets)
    widened: set[torch.dtype] = set()
    for parent, name in targets:  # (parent, name): `targets` holds no weight alive
        linear = getattr(parent, name)
        compute = compute_dtype(linear.weight.dtype)
        try:
            setattr(parent, name, PackedLinear(linear.weight, linear.bias, compute))
        except RuntimeError as e:
            logger.warning("oneDNN cannot pack %s (%s); it stays torch's linear", linear, e)
            packed -= 1
            continue
        if compute != linear.weight.dtype:
            widened.add(linear.weight.dtype)
    for dtype in widened:
        logger.info(
            "oneDNN has no %s GEMM on this CPU: the %s linear weights are packed in float32 "
            "(twice their bytes) and computed there",
            dtype,
            dtype,
        )
    return packed
