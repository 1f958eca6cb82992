"""Attention backends over the paged KV cache: the torch reference (every device; the oracle)
and the CUDA kernels. `select_backend` picks one; both build per-step metadata with the same
``build(...)`` arguments and attend through ``meta.attend(q, k, v, key_cache, value_cache,
scale)``."""

from __future__ import annotations

from typing import Protocol

import torch

from pagedrs.attention.torch_ref import AttentionMetadata as TorchAttentionMetadata

BACKENDS = ("auto", "torch", "cuda")


class AttentionMetadata(Protocol):
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, scale: float) -> torch.Tensor: ...


def select_backend(name: str, device: torch.device) -> str:
    """``"auto"``: the CUDA kernels on a CUDA device, the torch reference elsewhere."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        return "cuda" if device.type == "cuda" else "torch"
    if name == "cuda" and device.type != "cuda":
        raise ValueError(f"attention_backend 'cuda' needs a CUDA device, the engine runs on {device}")
    return name


def metadata_class(backend: str) -> type:
    if backend == "cuda":
        from pagedrs.attention.cuda_backend import CudaAttentionMetadata

        return CudaAttentionMetadata
    return TorchAttentionMetadata
