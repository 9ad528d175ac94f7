"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a replicated router, top-k experts per token.

The experts' weights are stacked, ``gate_up_proj`` ``[num_experts, 2 * intermediate, hidden]``
and ``down_proj`` ``[num_experts, hidden, intermediate]`` (transformers 5's layout), so one
expert's computation is two matmuls over every token routed to it. On CPU the (token, expert)
pairs are sorted by expert and each expert with tokens runs once (no per-token loop); on CUDA a
Triton grouped GEMM (``baton.engine.ops.fused_moe``) does all experts in one launch per matmul.

Under tensor parallelism each rank holds every expert's slice of the intermediate dimension
(column-parallel gate/up, row-parallel down, like a dense MLP) and the router whole, so every
rank routes every token identically and one all-reduce sums the partial outputs.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.models.config import ModelConfig
from baton.engine.models.tensor_parallel import ShardLayout, TensorParallel

# A checkpoint's per-expert weight (after the loader strips `model.` and renames Mixtral's
# `block_sparse_moe` to `mlp`): Mixtral's w1/w3/w2, Qwen's gate/up/down_proj.
_PER_EXPERT = re.compile(
    r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
# projection -> (stacked parameter, half of gate_up_proj or None for down_proj)
_STACKED = {
    "w1": ("gate_up_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "up_proj": ("gate_up_proj", 1),
    "w2": ("down_proj", None),
    "down_proj": ("down_proj", None),
}


def select_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts (in float32), then the top ``top_k``; with ``renormalize`` their
    weights are rescaled to sum to 1 (Mixtral always, Qwen3-MoE with ``norm_topk_prob``).

    Returns (weights [num_tokens, top_k] float32, expert ids [num_tokens, top_k] int64)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(
    x: torch.Tensor,  # [num_tokens, hidden]
    gate_up_proj: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    down_proj: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64
) -> torch.Tensor:  # [num_tokens, hidden]
    """Sum over each token's experts of weight * down(silu(gate(x)) * up(x))."""
    if x.is_cuda:
        from baton.engine.ops.fused_moe import fused_moe

        return fused_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    return _grouped_experts(x, gate_up_proj, down_proj, topk_weights, topk_ids)


def _grouped_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, _ = gate_up_proj.shape
    flat_ids = topk_ids.reshape(-1)  # [num_tokens * top_k] pair p = token * top_k + slot
    # Stable, so each expert's tokens stay in order and a token's contributions are summed in
    # expert order below, as transformers sums them.
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert
    token_of = order // top_k  # [pairs] the token of each grouped pair
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    grouped_x = x.index_select(0, token_of)  # [pairs, hidden]
    grouped_out = torch.empty_like(grouped_x)
    start = 0
    for expert, count in enumerate(counts):  # a loop over experts: one matmul pair each
        if count == 0:
            continue
        rows = slice(start, start + count)
        gate, up = F.linear(grouped_x[rows], gate_up_proj[expert]).split(two_inter // 2, dim=-1)
        grouped_out[rows] = F.linear(F.silu(gate) * up, down_proj[expert])
        start += count
    scaled = grouped_out * topk_weights.reshape(-1)[order].unsqueeze(-1)  # float32
    out = torch.zeros(num_tokens, x.shape[1], dtype=scaled.dtype, device=x.device)
    out.index_add_(0, token_of, scaled)
    return out.to(x.dtype)


class Experts(nn.Module):
    """This rank's slice of every expert's intermediate dimension, stacked."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))


class SparseMoeBlock(nn.Module):
    """The router (`gate`, replicated) and the experts (sharded), then one all-reduce."""

    def __init__(self, config: ModelConfig, layout: ShardLayout, tp: TensorParallel) -> None:
        super().__init__()
        if config.hidden_activation != "silu":
            raise ValueError(
                f"mixture-of-experts layers support the silu activation, "
                f"not {config.hidden_activation!r}"
            )
        self.tp = tp
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden_size, layout.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = fused_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        return self.tp.all_reduce(out)


def load_expert_weight(
    name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter], dtype: torch.dtype
) -> str | None:
    """Copies a per-expert checkpoint weight (already this rank's shard) into its slice of the
    stacked parameter and returns the key that records it as loaded (see `per_expert_keys`);
    None when `name` is not a per-expert weight."""
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
    stacked, half = _STACKED[proj]
    target = f"{prefix}.{stacked}"
    param = params.get(target)
    if param is None or expert >= param.shape[0]:
        raise ValueError(f"unexpected expert weight {name!r}: the model has no {target}[{expert}]")
    dst = param[expert]
    if half is not None:
        rows = param.shape[1] // 2
        dst = dst.narrow(0, half * rows, rows)
    if dst.shape != tensor.shape:
        raise ValueError(
            f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(tensor.to(dtype))
    return f"{target}#{expert}" + ("" if half is None else f"#{half}")


def per_expert_keys(name: str, param: torch.Tensor) -> set[str] | None:
    """The keys `load_expert_weight` records for a stacked expert parameter filled expert by
    expert; None for any other parameter."""
    if name.endswith("experts.gate_up_proj"):
        return {f"{name}#{e}#{h}" for e in range(param.shape[0]) for h in (0, 1)}
    if name.endswith("experts.down_proj"):
        return {f"{name}#{e}" for e in range(param.shape[0])}
    return None
