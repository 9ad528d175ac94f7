"""Tensor parallelism for the model: which shard of each weight a rank holds, and its collectives.

Megatron's split: q/k/v and gate/up are column-parallel (each rank computes its heads and its
slice of the MLP, no communication), o_proj and down_proj are row-parallel (each rank holds the
matching input columns; their partial outputs are summed with one all-reduce), and the embedding
and LM head are split by vocabulary rows. KV heads are split like the query heads; where the
model has fewer KV heads than ranks, each rank holds the one KV head its query heads read, so
that head is replicated on `size / num_kv_heads` ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from baton.engine.models.config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """One rank's view of its tensor-parallel group; with `size` 1 every collective is a no-op."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None: the default group (or no group at size 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates every rank's `x` along the last dimension, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class ShardLayout:
    """The slice of the model one rank holds. `build` checks that the model splits evenly."""

    rank: int
    size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    kv_head_start: int  # the first of the model's KV heads this rank holds
    intermediate_size: int  # MLP columns on this rank
    vocab_start: int  # the first vocabulary row on this rank
    vocab_per_rank: int  # rows per rank; the last rank's shard is padded past vocab_size
    vocab_size: int  # the model's, unpadded
    moe_intermediate_size: int = 0  # each expert's MLP columns on this rank (0: dense model)

    @classmethod
    def build(cls, config: ModelConfig, rank: int = 0, size: int = 1) -> ShardLayout:
        heads, kv_heads = config.num_heads, config.num_kv_heads
        if heads % size:
            raise ValueError(
                f"tensor_parallel_size {size} must divide the model's {heads} attention heads"
            )
        if config.intermediate_size % size:
            raise ValueError(
                f"tensor_parallel_size {size} must divide the model's intermediate_size "
                f"{config.intermediate_size}"
            )
        if kv_heads >= size:
            if kv_heads % size:
                raise ValueError(
                    f"tensor_parallel_size {size} must divide the model's {kv_heads} KV heads"
                )
            local_kv, kv_start = kv_heads // size, rank * (kv_heads // size)
        else:  # fewer KV heads than ranks: replicate each over size / kv_heads ranks
            if size % kv_heads:
                raise ValueError(
                    f"the model's {kv_heads} KV heads cannot be replicated evenly over "
                    f"tensor_parallel_size {size}"
                )
            local_kv, kv_start = 1, rank // (size // kv_heads)
        if config.moe_intermediate_size % size:
            raise ValueError(
                f"tensor_parallel_size {size} must divide the model's moe_intermediate_size "
                f"{config.moe_intermediate_size}"
            )
        per_rank = -(-config.vocab_size // size)
        return cls(
            rank=rank,
            size=size,
            num_heads=heads // size,
            num_kv_heads=local_kv,
            kv_head_start=kv_start,
            intermediate_size=config.intermediate_size // size,
            vocab_start=rank * per_rank,
            vocab_per_rank=per_rank,
            vocab_size=config.vocab_size,
            moe_intermediate_size=config.moe_intermediate_size // size,
        )

    def shard(self, name: str, tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
        """This rank's slice of the checkpoint tensor `name` (a Hugging Face name without the
        `model.` prefix); replicated weights (norms) come back whole."""
        if self.size == 1:
            return tensor
        if ".experts." in name:
            return self._shard_expert(name, tensor)
        module = name.rsplit(".", 2)[-2]  # "layers.0.self_attn.q_proj.weight" -> q_proj
        heads, kv_heads = self.num_heads * head_dim, self.num_kv_heads * head_dim
        mlp = self.intermediate_size
        # module -> (dim, start, length): column-parallel rows (dim 0), row-parallel columns (1)
        slices = {
            "q_proj": (0, self.rank * heads, heads),
            "k_proj": (0, self.kv_head_start * head_dim, kv_heads),
            "v_proj": (0, self.kv_head_start * head_dim, kv_heads),
            "gate_proj": (0, self.rank * mlp, mlp),
            "up_proj": (0, self.rank * mlp, mlp),
            "o_proj": (1, self.rank * heads, heads),
            "down_proj": (1, self.rank * mlp, mlp),
        }
        if module in ("o_proj", "down_proj") and name.endswith(".bias"):
            # A row-parallel layer's bias is added once, to the sum of the ranks' partial
            # products: rank 0 holds it, the others zeros.
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        if module in slices:
            return tensor.narrow(*slices[module])
        if module in ("embed_tokens", "lm_head"):
            end = min(self.vocab_start + self.vocab_per_rank, self.vocab_size)
            return tensor.narrow(0, self.vocab_start, max(0, end - self.vocab_start))
        return tensor

    def _shard_expert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Each expert's intermediate dimension splits like a dense MLP's: per-expert gate/up
        (`w1`/`w3`) by rows, down (`w2`) by columns; transformers 5's stacked `gate_up_proj`
        [experts, 2 * inter, hidden] in both halves, `down_proj` [experts, hidden, inter] by
        its last dim."""
        inter = self.moe_intermediate_size
        start = self.rank * inter
        if name.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            return torch.cat((gate.narrow(1, start, inter), up.narrow(1, start, inter)), dim=1)
        if name.endswith("experts.down_proj"):
            return tensor.narrow(2, start, inter)
        module = name.rsplit(".", 2)[-2]
        if module in ("w1", "w3", "gate_proj", "up_proj"):
            return tensor.narrow(0, start, inter)
        if module in ("w2", "down_proj"):
            return tensor.narrow(1, start, inter)
        return tensor


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows are split over the ranks: each looks up the ids it holds, writes
    zeros for the others, and an all-reduce assembles the full rows."""

    def __init__(self, layout: ShardLayout, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(layout.vocab_per_rank, hidden_size))
        self.start = layout.vocab_start
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)
