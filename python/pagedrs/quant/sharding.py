"""Bias loading shared by the packed (`pagedrs.quant.layers`) and FP8 (`pagedrs.quant.fp8`)
replacements of the dense parallel linears: the weight changes format, the bias does not, and
it is sharded exactly as the dense layer shards it."""

from __future__ import annotations

from typing import Any

from torch import nn


class ColumnShardBias:
    """``load_bias`` of a column-parallel layer: this rank's rows of each logical output's bias.
    The layer sets ``bias`` and ``shard_rows`` (the dense layer's ``_rows`` per logical output)."""

    bias: nn.Parameter | None
    shard_rows: list[tuple[slice, slice]]
    """Per logical output: (rows of the full checkpoint tensor, where they go here)."""

    def load_bias(self, shard: int, bias: Any) -> None:
        if self.bias is None:
            raise ValueError("checkpoint has a bias for a layer built without one")
        source, target = self.shard_rows[shard]
        self.bias[target].copy_(bias[source])


class ReplicatedBias:
    """``load_bias`` of a row-parallel layer: the whole bias on every rank, added once after
    the reduction. The layer sets ``bias``."""

    bias: nn.Parameter | None

    def load_bias(self, bias: Any) -> None:
        if self.bias is None:
            raise ValueError("checkpoint has a bias for a layer built without one")
        self.bias.copy_(bias[:])
