"""Adapters in a bounded set of slots on the model's device, and the batched update.

Every patched linear (`LINEARS` of every decoder layer) gets one stack of ``max_loras`` slots:
``a`` of ``[slots, slices, max_rank, in]`` and, per output slice, ``b[j]`` of
``[slots, max_rank, out_j]`` (``B`` transposed: the expand adds whole rows of it). An adapter
of a smaller rank fills the first ranks of its slot and leaves the rest zero, and a linear it
does not patch stays zero in its slot, so every slot multiplies the same shapes.

A step's rows use different adapters (or none): `LoRABatch` groups the rows by slot once per
step, and `LoRASlots.add` applies each group's update to a linear's output: one shrink
(``x A^T`` over every slice at once) and one expand per slice, as punica's SGMV does with a
kernel per group. This is the torch reference; rows without an adapter cost nothing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedrs.layers import fused
from pagedrs.lora.adapter import LINEARS, LoRAAdapter, _shard

if TYPE_CHECKING:
    from pagedrs.models.decoder import DecoderForCausalLM


@dataclass(frozen=True)
class LoRABatch:
    """The step's rows grouped by slot: ``(slot, row indices on the device)`` for every slot
    some row uses; rows without an adapter are in no group."""

    groups: list[tuple[int, torch.Tensor]]
    row_slots: torch.Tensor
    """Each row's slot (-1: none), int64 on the device: what the Triton kernels read."""

    @classmethod
    def of(cls, row_slots: np.ndarray, device: torch.device) -> LoRABatch | None:
        """``row_slots``: each row's slot, -1 for none; ``None`` when no row has an adapter."""
        slots = np.ascontiguousarray(row_slots, dtype=np.int64)
        used = np.unique(slots[slots >= 0])
        if len(used) == 0:
            return None
        groups = [(int(slot), torch.from_numpy(np.flatnonzero(slots == slot)).to(device)) for slot in used]
        return cls(groups, torch.from_numpy(slots).to(device))


class LoRASlots:
    """``max_loras`` slots of adapter updates for every patched linear of ``model``."""

    def __init__(
        self, model: DecoderForCausalLM, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype
    ):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be at least 1, got {max_loras} and {max_rank}")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], list[torch.Tensor]] = {}
        self.output_sizes: dict[tuple[int, str], list[int]] = {}
        self.reduced: set[tuple[int, str]] = set()
        """Row-parallel linears under tensor parallelism: each rank shrinks its input columns,
        and the shrunk activations are summed across ranks before the expand (vLLM does the
        same), so every rank adds the whole update to the reduced output."""
        for layer in range(len(model.decoder_layers())):
            for linear in LINEARS:
                try:
                    shard = _shard(model, layer, linear)
                except ValueError:
                    continue  # latent attention, experts: never patched (load_adapter refuses them)
                key = (layer, linear)
                in_size, output_sizes = shard.local_in, shard.local_outputs
                if shard.row_parallel:
                    self.reduced.add(key)
                self.output_sizes[key] = output_sizes
                self.a[key] = torch.zeros(max_loras, len(output_sizes), max_rank, in_size, device=device, dtype=dtype)
                self.b[key] = [
                    torch.zeros(max_loras, max_rank, size, device=device, dtype=dtype) for size in output_sizes
                ]

    @property
    def num_bytes(self) -> int:
        tensors = [*self.a.values(), *(b for parts in self.b.values() for b in parts)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Puts ``adapter`` in ``slot`` (whatever was there is overwritten)."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is not one of the {self.max_loras} slots")
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}, above max_lora_rank ({self.max_rank})")
        unknown = set(adapter.layers) - set(self.a)
        if unknown:
            raise ValueError(f"adapter {adapter.name!r} patches linears this model has no slots for: {sorted(unknown)}")
        self.clear(slot)
        for key, weights in adapter.layers.items():
            for j, (a, b) in enumerate(zip(weights.a, weights.b)):
                if a is None or b is None:
                    continue
                rank = a.shape[0]
                self.a[key][slot, j, :rank].copy_(a)
                self.b[key][j][slot, :rank].copy_(b.T)

    def clear(self, slot: int) -> None:
        for key, a in self.a.items():
            a[slot].zero_()
            for b in self.b[key]:
                b[slot].zero_()

    def add(self, key: tuple[int, str], x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        """``y`` (the linear's output for ``x``) plus each row's adapter update, in place: Triton
        kernels on a GPU (`pagedrs.layers.fused.enabled`), else torch ops per adapter group."""
        if fused.enabled(y) and y.is_contiguous():
            return self._add_triton(key, x, y, batch)
        a_slots, b_slots = self.a[key], self.b[key]
        sizes = self.output_sizes[key]
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        # One shrink for every slice per group: [rows, slices, max_rank].
        shrunk = [
            (x.index_select(0, rows) @ a_slots[slot].reshape(-1, a_slots.shape[-1]).T).view(len(rows), len(sizes), -1)
            for slot, rows in batch.groups
        ]
        if key in self.reduced:
            every_row = x.new_zeros(x.shape[0], len(sizes), self.max_rank)
            for (_, rows), part in zip(batch.groups, shrunk):
                every_row.index_copy_(0, rows, part)
            torch.distributed.all_reduce(every_row)
            shrunk = [every_row.index_select(0, rows) for _, rows in batch.groups]
        for (slot, rows), part in zip(batch.groups, shrunk):
            for j, (start, size) in enumerate(zip(starts, sizes)):
                update = part[:, j] @ b_slots[j][slot]
                y[:, start : start + size].index_add_(0, rows, update)
        return y

    def _add_triton(self, key: tuple[int, str], x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        from pagedrs.lora import triton_kernels

        x = x.contiguous()
        num_tokens, in_size = x.shape
        sizes = self.output_sizes[key]
        rank, slices = self.max_rank, len(sizes)
        block_r = max(16, 1 << (rank - 1).bit_length())
        shrunk = torch.zeros(num_tokens, slices, rank, dtype=torch.float32, device=x.device)
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            triton_kernels.lora_shrink[(num_tokens, slices)](
                x, self.a[key], batch.row_slots, shrunk, in_size, rank, slices, BLOCK_R=block_r, BLOCK_K=64
            )
            if key in self.reduced:
                torch.distributed.all_reduce(shrunk)
            start = 0
            for part, (size, b) in enumerate(zip(sizes, self.b[key])):
                triton_kernels.lora_expand[(num_tokens, -(-size // 64))](
                    shrunk, b, batch.row_slots, y, part, slices, rank, size, y.shape[1], start,
                    BLOCK_R=block_r, BLOCK_N=64,
                )  # fmt: skip
                start += size
        return y


class LoRAState:
    """The model's adapter slots and the current step's `LoRABatch` (``None``: no row of the
    step has an adapter, and every hook returns at once)."""

    def __init__(self, slots: LoRASlots):
        self.slots = slots
        self.batch: LoRABatch | None = None

    def attach(self, model: DecoderForCausalLM) -> None:
        """Gives each decoder layer's attention and MLP its `LoRAHook`."""
        from pagedrs.models.decoder import MLP, Attention

        for index, layer in enumerate(model.decoder_layers()):
            for module in (layer.self_attn, layer.mlp):
                if isinstance(module, (Attention, MLP)):
                    module.lora = LoRAHook(self, index)


class LoRAHook:
    """What a layer's module calls after each linear an adapter may patch: the linear's output
    plus the step's updates for the rows that have adapters."""

    def __init__(self, state: LoRAState, layer: int):
        self.state, self.layer = state, layer

    def __call__(self, linear: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch = self.state.batch
        key = (self.layer, linear)
        if batch is None or key not in self.state.slots.a:
            return y
        return self.state.slots.add(key, x, y, batch)
