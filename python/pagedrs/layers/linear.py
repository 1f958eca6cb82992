"""Linear layers that hold one tensor-parallel shard of their weight.

Column-parallel layers split the output features across ranks (each rank computes its slice
of heads or of the MLP's intermediate features); row-parallel layers split the input
features and all-reduce their partial sums. With ``tp.size == 1`` both are plain linears.
Loaders take a lazy handle of the full checkpoint tensor (`pagedrs.checkpoint.WeightHandle`)
and read only this rank's slice of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pagedrs.checkpoint import WeightHandle


@dataclass(frozen=True)
class TensorParallel:
    """Which shard this process holds."""

    rank: int = 0
    size: int = 1

    def split(self, total: int, what: str) -> int:
        """This rank's part of ``total`` (which must divide evenly)."""
        if total % self.size != 0:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {self.size}")
        return total // self.size

    def replicas(self, num_heads: int, what: str) -> int:
        """How many ranks hold each of ``num_heads`` heads: 1 when the heads split across
        ranks, ``size / num_heads`` when there are fewer heads than ranks (each rank then holds
        one head, as vLLM replicates KV heads)."""
        if num_heads >= self.size:
            self.split(num_heads, what)
            return 1
        if self.size % num_heads != 0:
            raise ValueError(
                f"the tensor-parallel size {self.size} is not a multiple of {what} ({num_heads}), "
                "so its heads can neither be split nor replicated evenly"
            )
        return self.size // num_heads


def _all_reduce(tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    if tp.size > 1:
        torch.distributed.all_reduce(tensor)
    return tensor


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with this rank's slice of the output features.

    ``output_sizes`` lists the logical outputs fused into this layer (e.g. q, k and v, or gate
    and up); each is split across ranks on its own, so a fused layer shards consistently.
    ``replicas[i]`` ranks hold the same shard of output ``i`` (KV heads when there are fewer of
    them than ranks); 1 by default.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        tp: TensorParallel,
        dtype: torch.dtype,
        replicas: list[int] | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.replicas = replicas or [1] * len(output_sizes)
        num_shards = [tp.size // replicas for replicas in self.replicas]
        self.output_sizes = [size // shards for size, shards in zip(output_sizes, num_shards)]
        for size, shards in zip(output_sizes, num_shards):
            if size % shards != 0:
                raise ValueError(f"output size ({size}) is not divisible into {shards} tensor-parallel shards")
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        total = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(total, input_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(total, dtype=dtype), requires_grad=False) if bias else None

    def _rows(self, shard: int) -> tuple[slice, slice]:
        """(rows of the full checkpoint tensor this rank holds, where they go here)."""
        size, offset = self.output_sizes[shard], self.offsets[shard]
        index = self.tp.rank // self.replicas[shard]
        return slice(index * size, (index + 1) * size), slice(offset, offset + size)

    def load(self, shard: int, weight: WeightHandle) -> None:
        """Copies this rank's rows of logical output ``shard`` from a full checkpoint tensor."""
        source, target = self._rows(shard)
        self.weight[target].copy_(weight[source])

    def load_bias(self, shard: int, bias: WeightHandle) -> None:
        if self.bias is None:
            raise ValueError("checkpoint has a bias for a layer built without one")
        source, target = self._rows(shard)
        self.bias[target].copy_(bias[source])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with this rank's slice of the input features; partial sums are
    all-reduced across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallel, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.input_size = tp.split(input_size, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype), requires_grad=False) if bias else None

    def input_cols(self) -> slice:
        """This rank's columns (input features) of the full checkpoint tensor."""
        return slice(self.tp.rank * self.input_size, (self.tp.rank + 1) * self.input_size)

    def load(self, weight: WeightHandle) -> None:
        """Copies this rank's columns from a full checkpoint tensor."""
        self.weight.copy_(weight[:, self.input_cols()])

    def load_bias(self, bias: WeightHandle) -> None:
        """The bias is not sharded: every rank adds it after the reduction."""
        if self.bias is None:
            raise ValueError("checkpoint has a bias for a layer built without one")
        self.bias.copy_(bias[:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the reduction.
        out = _all_reduce(F.linear(x, self.weight), self.tp)
        return out + self.bias if self.bias is not None else out


class VocabEmbedding(nn.Module):
    """Token embeddings; rank ``r`` holds rows ``[r * S, (r + 1) * S)`` of the vocabulary, with
    ``S = ceil(V / tp)``: a vocabulary that does not divide evenly is padded with zero rows on
    the last rank (their logits are cut off after the gather), as vLLM pads it."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp.size)
        self.start = tp.rank * self.shard_size
        self.num_rows = max(0, min(self.shard_size, vocab_size - self.start))
        """Rows of the checkpoint this rank holds (the rest of its shard is padding)."""
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size, dtype=dtype), requires_grad=False)

    def load(self, weight: WeightHandle) -> None:
        self.weight[: self.num_rows].copy_(weight[self.start : self.start + self.num_rows])

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.start
        inside = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * inside.unsqueeze(-1)
        return _all_reduce(out, self.tp)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary on rank 0, which samples; each rank computes its
        slice and rank 0 gathers them. Other ranks get their own slice back (unused)."""
        return gather_logits(F.linear(hidden, self.weight), self.tp, self.vocab_size)


def gather_logits(local: torch.Tensor, tp: TensorParallel, vocab_size: int) -> torch.Tensor:
    """Rank 0 gathers every rank's vocabulary slice of the logits (``[rows, V / tp]`` each)
    into ``[rows, vocab_size]`` (dropping the padding rows of the last shard); other ranks get
    their own slice back."""
    if tp.size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tp.size)] if tp.rank == 0 else None
    torch.distributed.gather(local.contiguous(), parts, dst=0)
    if parts is None:
        return local
    return torch.cat(parts, dim=-1)[:, :vocab_size]
