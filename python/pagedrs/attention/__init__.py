"""Attention backends over the paged KV cache: the torch reference (every device; the oracle),
the compiled CPU kernel and the GPU kernels (CUDA and Triton, chosen per phase by
`pagedrs.attention.kernel_choice`). `select_backend` picks one, as an `AttentionBackend`
object; every kind builds per-step metadata with the same ``build(...)`` arguments and attends
through ``meta.attend(q, k, v, key_cache, value_cache, scale)``."""

from __future__ import annotations

import torch

from pagedrs.attention.backend import (
    BACKENDS,
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataClass,
    CpuBackend,
    GpuBackend,
    StepViews,
    TorchBackend,
)
from pagedrs.attention.cuda_backend import cuda_supports
from pagedrs.attention.kernel_choice import choose_plan, why_not
from pagedrs.kernels import cpu as cpu_kernels
from pagedrs.kernels import cuda as cuda_kernels
from pagedrs.kernels import triton as triton_runtime

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionMetadataClass",
    "CpuBackend",
    "GpuBackend",
    "StepViews",
    "TorchBackend",
    "select_backend",
]


def select_backend(
    name: str,
    device: torch.device,
    head_dim: int = 64,
    num_heads: int = 1,
    num_kv_heads: int = 1,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    softcap: bool = False,
    sinks: bool = False,
) -> AttentionBackend:
    """The backend ``attention_backend=name`` runs for a model of this attention shape on
    ``device``: the one place the choice is made.

    - ``"auto"``: on a CUDA device the GPU kernels (``"cuda"``) when one of them supports the
      shape, CUDA or Triton per phase by timing both in ``dtype`` (`choose_plan`); on the CPU
      the compiled CPU kernel when it builds here (any shape); the torch reference otherwise,
      and where no GPU kernel ran in the timing.
    - A forced ``"cpu"`` or ``"cuda"`` builds its kernels now, so a model never starts on
      kernels that cannot run.
    - ``"triton"``: the Triton kernels for every phase (on a CPU only under
      ``TRITON_INTERPRET=1``, which is how the tests run them).

    ``softcap``: the model softcaps attention scores (Gemma 2), which the CUDA kernels do
    not: on a GPU ``"auto"`` then plans Triton for both phases, and ``"cuda"`` is refused.
    ``sinks``: the model's attention has sinks (gpt-oss), which only the CPU kernel and the
    torch reference compute: on a GPU ``"auto"`` is the reference, ``"cuda"`` and ``"triton"``
    are refused.
    """
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if sinks and name in ("cuda", "triton"):
        raise ValueError(f"attention_backend {name!r} has no attention sinks (this model's); use 'auto' or 'torch'")
    if sinks and name == "auto" and device.type == "cuda":
        name = "torch"
    if softcap and name == "cuda":
        raise ValueError("attention_backend 'cuda' has no attention softcap (this model's); use 'triton' or 'auto'")
    if softcap and name == "auto" and device.type == "cuda":
        usable = triton_runtime.available() and why_not("triton", head_dim, num_heads, num_kv_heads, block_size) is None
        name = "triton" if usable else "torch"
    kind = _kind(name, device, head_dim, num_heads, num_kv_heads, block_size)
    if kind == "torch":
        return TorchBackend()
    if kind == "cpu":
        return CpuBackend()
    plan = choose_plan(name, device, dtype, num_heads, num_kv_heads, head_dim, block_size)
    if plan is None:  # no GPU kernel ran here (choose_plan logged why): the reference
        return TorchBackend()
    if plan.uses("cuda"):
        cuda_kernels.load()  # build the kernels now, not in the first request's step
    return GpuBackend(kind, plan)


def _kind(name: str, device: torch.device, head_dim: int, num_heads: int, num_kv_heads: int, block_size: int) -> str:
    """Which backend ``name`` means here (``"auto"`` resolved); raises where it cannot run."""
    if name == "auto":
        if device.type == "cuda":
            gpu_kernels = [why_not(k, head_dim, num_heads, num_kv_heads, block_size) for k in ("cuda", "triton")]
            return "cuda" if None in gpu_kernels else "torch"
        if device.type == "cpu":
            return "cpu" if cpu_kernels.available() else "torch"
        return "torch"
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on the CPU, the engine runs on {device}; use 'auto'")
    if name == "cpu":
        try:
            cpu_kernels.load()  # build now, not in the first request's step
        except Exception as error:  # the compiler's own message, one level up
            raise RuntimeError(
                f"attention_backend 'cpu': the CPU kernel did not build ({error}); use 'torch'"
            ) from error
    if name == "cuda" and device.type != "cuda":
        raise ValueError(f"attention_backend 'cuda' needs a CUDA device, the engine runs on {device}")
    unsupported = cuda_supports(head_dim, num_heads, num_kv_heads)
    if name == "cuda" and unsupported is not None:
        raise ValueError(f"attention_backend 'cuda' does not support {unsupported}; use 'torch'")
    if name == "triton":
        if device.type != "cuda" and not (triton_runtime.available() and triton_runtime.interpreting()):
            raise ValueError(f"attention_backend 'triton' needs a CUDA device, the engine runs on {device}")
        why = why_not("triton", head_dim, num_heads, num_kv_heads, block_size)
        if why is not None:
            raise ValueError(f"attention_backend 'triton' does not support {why}; use 'torch'")
    return name
