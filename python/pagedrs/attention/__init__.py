"""Attention backends over the paged KV cache: the torch reference (every device; the oracle),
the compiled CPU kernel and the GPU kernels (CUDA and Triton, chosen per phase by
`pagedrs.attention.kernel_choice`). `select_backend` picks one; all build per-step metadata
with the same ``build(...)`` arguments and attend through ``meta.attend(q, k, v, key_cache,
value_cache, scale)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from pagedrs.attention.torch_ref import AttentionMetadata as TorchAttentionMetadata

BACKENDS = ("auto", "torch", "cpu", "cuda", "triton")


class AttentionMetadata(Protocol):
    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor: ...


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


CUDA_HEAD_SIZES = (64, 128)
CUDA_MAX_GROUP = 16


def cuda_supports(head_dim: int, num_heads: int, num_kv_heads: int) -> str | None:
    """Why the CUDA kernels cannot run this model's attention, or ``None`` if they can."""
    if head_dim not in CUDA_HEAD_SIZES:
        return f"head size {head_dim} (the kernels take {' and '.join(map(str, CUDA_HEAD_SIZES))})"
    if num_heads // num_kv_heads > CUDA_MAX_GROUP:
        return f"{num_heads // num_kv_heads} query heads per KV head (the kernels take at most {CUDA_MAX_GROUP})"
    return None


def select_backend(
    name: str,
    device: torch.device,
    head_dim: int = 64,
    num_heads: int = 1,
    num_kv_heads: int = 1,
    block_size: int = 16,
) -> str:
    """``"auto"``: on a CUDA device the GPU kernels (``"cuda"``: CUDA or Triton per phase, see
    `pagedrs.attention.kernel_choice`) when one of them supports the model's attention shape;
    on the CPU the compiled CPU kernel when it builds here (any shape); the torch reference
    otherwise. A forced ``"cpu"`` or ``"cuda"`` builds its kernels now, so a model never
    starts on kernels that cannot run. ``"triton"``: the Triton kernels for every phase (on a
    CPU only under ``TRITON_INTERPRET=1``, which is how the tests run them)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    unsupported = cuda_supports(head_dim, num_heads, num_kv_heads)
    if name == "auto":
        if device.type == "cuda":
            from pagedrs.attention.kernel_choice import why_not

            gpu_kernels = [why_not(k, head_dim, num_heads, num_kv_heads, block_size) for k in ("cuda", "triton")]
            return "cuda" if None in gpu_kernels else "torch"
        if device.type == "cpu":
            from pagedrs.attention.cpu_ops import available

            return "cpu" if available() else "torch"
        return "torch"
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on the CPU, the engine runs on {device}; use 'auto'")
    if name == "cpu":
        from pagedrs.attention.cpu_ops import load

        try:
            load()  # build now, not in the first request's step
        except Exception as error:  # the compiler's own message, one level up
            raise RuntimeError(
                f"attention_backend 'cpu': the CPU kernel did not build ({error}); use 'torch'"
            ) from error
    if name == "cuda" and device.type != "cuda":
        raise ValueError(f"attention_backend 'cuda' needs a CUDA device, the engine runs on {device}")
    if name == "cuda" and unsupported is not None:
        raise ValueError(f"attention_backend 'cuda' does not support {unsupported}; use 'torch'")
    if name == "triton":
        from pagedrs.attention import triton_attention
        from pagedrs.attention.kernel_choice import why_not

        if device.type != "cuda" and not (triton_attention.available() and triton_attention.interpreting()):
            raise ValueError(f"attention_backend 'triton' needs a CUDA device, the engine runs on {device}")
        why = why_not("triton", head_dim, num_heads, num_kv_heads, block_size)
        if why is not None:
            raise ValueError(f"attention_backend 'triton' does not support {why}; use 'torch'")
    return name


def metadata_class(backend: str) -> AttentionMetadataClass:
    if backend == "cpu":
        from pagedrs.attention.cpu_backend import CpuAttentionMetadata

        return CpuAttentionMetadata
    if backend == "cuda":  # the CUDA kernels for both phases (the runner builds through its KernelPlan)
        from pagedrs.attention.cuda_backend import CudaAttentionMetadata

        return CudaAttentionMetadata
    return TorchAttentionMetadata
