"""What an attention backend offers the model runner: `AttentionBackend`, one small class per
kind (`TorchBackend`, `CpuBackend`, `GpuBackend`), chosen once per model by
`pagedrs.attention.select_backend`; and the protocol every kind's per-step metadata follows.

The runner asks the backend object, never its name: ``backend.metadata.build(...)`` each step,
``backend.copy_blocks(...)`` for copy-on-write, ``backend.graphable`` for CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, get_args

import numpy as np
import torch

from pagedrs.attention.cpu_backend import CpuAttentionMetadata
from pagedrs.attention.cuda_backend import KernelPlan
from pagedrs.attention.torch_ref import AttentionMetadata as TorchAttentionMetadata
from pagedrs.config import AttentionBackendName
from pagedrs.kernels import cuda as cuda_kernels

BACKENDS: tuple[str, ...] = get_args(AttentionBackendName)
"""The ``attention_backend`` values; ``"auto"`` picks one of the others."""


class AttentionMetadata(Protocol):
    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


Meta = TypeVar("Meta")


@dataclass
class StepViews(Generic[Meta]):
    """A step's attention metadata when the layers attend with more than one view (a KV layer
    group's blocks under one window, `pagedrs.engine.kv_layout`): one metadata per view, and
    which view each layer reads."""

    metas: list[Meta]
    layer_views: tuple[int, ...]

    def of_layer(self, index: int) -> Meta:
        return self.metas[self.layer_views[index]]


class AttentionMetadataClass(Protocol):
    """A backend's metadata class; `build` makes one step's metadata from the scheduler's arrays."""

    def build(
        self,
        *,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        query_start_loc: np.ndarray,
        context_lens: np.ndarray,
        block_tables: np.ndarray,
        block_size: int,
        sliding_window: int | None,
        device: torch.device,
        upload: Callable[..., list[torch.Tensor]] | None = None,
    ) -> AttentionMetadata: ...


class AttentionBackend:
    """One attention backend, as the model runner uses it.

    - `name`: the ``attention_backend`` value that selects it (``"torch"``, ``"cpu"``,
      ``"cuda"``, ``"triton"``);
    - `metadata`: builds each step's metadata, which every layer attends through;
    - `kernel_plan`: which GPU kernels run each phase (``None`` off the GPU kernels);
    - `copy_blocks`: a step's copy-on-write copies, in every layer's caches.
    """

    name: str
    metadata: AttentionMetadataClass
    kernel_plan: KernelPlan | None = None

    @property
    def graphable(self) -> bool:
        """Whether decode steps can be captured as CUDA graphs (`pagedrs.engine.cuda_graphs`):
        only the GPU kernels launch with a grid that does not follow the step's contexts."""
        return self.kernel_plan is not None

    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_copies: torch.Tensor) -> None:
        """Copies block ``src`` onto block ``dst`` of every layer's key and value caches, for
        each row ``(src, dst)`` of ``block_copies`` (``long [num_copies, 2]``, on the caches'
        device), before the step's forward pass."""
        for key_cache, value_cache in kv_caches:
            key_cache[block_copies[:, 1]] = key_cache[block_copies[:, 0]]
            value_cache[block_copies[:, 1]] = value_cache[block_copies[:, 0]]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class TorchBackend(AttentionBackend):
    """The torch reference, on any device: what ``"auto"`` runs where no kernel takes the model."""

    name = "torch"
    metadata = TorchAttentionMetadata


class CpuBackend(AttentionBackend):
    """The compiled CPU kernel (``cpu/paged_attention.cpp``) and SDPA for long prefill chunks
    (`pagedrs.attention.cpu_backend`); the decoder stack (`pagedrs.models.cpu_stack`) reads its
    metadata."""

    name = "cpu"
    metadata = CpuAttentionMetadata


class GpuBackend(AttentionBackend):
    """The GPU kernels (`pagedrs.attention.cuda_backend`), CUDA or Triton for each phase as
    `kernel_plan` says: ``"cuda"`` (the plan measured per phase, or forced to CUDA) or
    ``"triton"`` (Triton for both)."""

    kernel_plan: KernelPlan

    def __init__(self, name: str, kernel_plan: KernelPlan):
        self.name = name
        self.kernel_plan = kernel_plan
        self.metadata = kernel_plan  # its build is `CudaAttentionMetadata.build` under the plan

    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_copies: torch.Tensor) -> None:
        if not self.kernel_plan.uses("cuda"):  # a Triton-only plan needs no nvcc: torch copies
            super().copy_blocks(kv_caches, block_copies)
            return
        ops = cuda_kernels.load()
        for key_cache, value_cache in kv_caches:
            ops.copy_blocks(key_cache, value_cache, block_copies)
