"""Engine settings and the defaults that depend on the machine."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagedrs.memory import parse_bytes

if TYPE_CHECKING:
    from pagedrs.spec_decode import SpeculativeConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


CPU_MEMORY_SHARE = 0.10
"""Share of RAM the engine's weights and KV cache may take together by default on the CPU."""
GPU_MEMORY_SHARE = 0.90
"""Share of a GPU's memory the weights, KV cache and activations may take (vLLM's default
``gpu_memory_utilization``)."""
GPU_ACTIVATION_RESERVE = 2**30
"""Bytes of that share kept for activations and the CUDA context."""


def default_kv_cache_memory(device: torch.device, weight_bytes: int = 0) -> int:
    """The KV budget when none is given. Weights and KV share the memory the engine may use,
    so smaller (quantized) weights leave more room for the cache:

    - CPU: `CPU_MEMORY_SHARE` of RAM minus the weights, never less than 5% of RAM (the budget
      before the weights counted, so a large float model keeps the cache it had), within
      256 MiB .. 4 GiB;
    - GPU: 30% of its memory, or less where the weights leave less: `GPU_MEMORY_SHARE` of it
      minus the weights and `GPU_ACTIVATION_RESERVE`. Weights that leave nothing are a
      ValueError.

    ``weight_bytes``: the weights this process holds (`pagedrs.quant.loading.predicted_weight_bytes`).
    """
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        room = int(total * GPU_MEMORY_SHARE) - weight_bytes - GPU_ACTIVATION_RESERVE
        if room <= 0:
            raise ValueError(
                f"the weights ({weight_bytes / 2**30:.1f} GiB) leave no room for a KV cache in "
                f"{GPU_MEMORY_SHARE:.0%} of this GPU's {total / 2**30:.1f} GiB; set kv_cache_memory"
            )
        return min(int(total * 0.3), room)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget = max(ram * CPU_MEMORY_SHARE - weight_bytes, ram * 0.05)
    return int(min(max(budget, 256 * 2**20), 4 * 2**30))


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"`` is float32 on CPU and bfloat16 on a GPU."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)} or 'auto', got {dtype}")
        return dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)} or 'auto', got {dtype!r}")
    return _DTYPES[dtype]


@dataclass
class EngineConfig:
    """Everything an `LLMEngine` is built from."""

    model: str | None = None
    """Checkpoint directory, GGUF file, or ``None`` for the default model."""
    dtype: str | torch.dtype = "auto"
    device: str | None = None
    """``"cpu"``, ``"cuda"``; ``None`` picks a GPU when there is one."""
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    """Bytes (or ``"2GiB"``) for the KV cache; ``None`` for `default_kv_cache_memory`."""
    max_model_len: int | None = None
    """``None``: the model's ``max_position_embeddings``."""
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int | None = None
    max_num_partial_prefills: int = 1
    scheduling_policy: str = "fcfs"
    seed: int | None = 0
    """Seed of the generator used by requests without their own seed."""
    attention_backend: str = "auto"
    """``"auto"`` (on a GPU the faster of the CUDA and Triton kernels per phase, measured at
    start-up; the compiled CPU kernel on the CPU; the torch reference where none can run),
    ``"torch"``, ``"cpu"``, ``"cuda"`` or ``"triton"``."""
    enforce_eager: bool = False
    """Never replay CUDA graphs: every decode step launches its kernels one by one. (By
    default decode steps on a GPU replay graphs captured at start-up, `pagedrs.engine.cuda_graphs`.)"""
    quantization: str = "auto"
    """Weights as vLLM spells it: ``"auto"`` keeps a GGUF's own 4/8-bit blocks (run by the CPU
    kernel, `pagedrs.quant`) and an FP8 checkpoint's e4m3 linears (``torch._scaled_mm`` on
    sm_89+ GPUs, dequantized on the fly elsewhere), ``"none"`` dequantizes to ``dtype``,
    ``"int8"`` quantizes a float checkpoint's linears to 8-bit blocks at load time (CPU),
    ``"fp8"`` to e4m3 with per-channel scales (any device)."""
    tensor_parallel_size: int = 1
    """Ranks the model is split across (one process each; see `pagedrs.engine.parallel`)."""
    distributed_backend: str | None = None
    """``torch.distributed`` backend: ``None`` picks ``"gloo"`` on CPU, ``"nccl"`` on CUDA."""
    distributed_timeout: float = 120.0
    """Seconds a collective may wait for a rank before the engine fails (a dead or stuck rank)."""
    nnodes: int = 1
    """Machines the ranks span; each runs ``tensor_parallel_size / nnodes`` of them."""
    node_rank: int = 0
    """This machine's index; node 0 runs rank 0, which schedules, samples and serves."""
    master_addr: str = "127.0.0.1"
    """Where rank 0 listens for the rendezvous (``MASTER_ADDR``)."""
    master_port: int | None = None
    """Rendezvous port (``MASTER_PORT``); ``None`` picks a free one (one node only)."""
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    """Speculative decoding, as vLLM's ``--speculative-config``: a dict, its JSON text or a
    `pagedrs.spec_decode.SpeculativeConfig` (see there). ``None``: off."""

    def torch_device(self) -> torch.device:
        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def kv_cache_bytes(self, device: torch.device, weight_bytes: int = 0) -> int:
        """One rank's KV budget: ``kv_cache_memory``, or `default_kv_cache_memory` for the
        model's ``weight_bytes`` (the whole model's, a draft model's included). Tensor-parallel
        ranks on the CPU share one RAM, so they split the default between them (each rank's
        cache holds its share of every token's KV: the token capacity stays that of one
        process); on GPUs each rank has its own memory and holds its share of the weights."""
        if self.kv_cache_memory is None:
            ranks = self.tensor_parallel_size
            if device.type == "cpu":
                return default_kv_cache_memory(device, weight_bytes) // ranks
            return default_kv_cache_memory(device, weight_bytes // ranks)
        return parse_bytes(self.kv_cache_memory)
