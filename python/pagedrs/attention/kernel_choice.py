"""Which GPU kernels run a model's attention, per phase: `choose_plan`.

``attention_backend="cuda"`` or ``"triton"`` forces one set of kernels; ``"auto"`` on a GPU
times every kernel that supports the model's attention shape on a decode batch and on a
prefill chunk of that shape (random cache, the model's dtype and block size) and keeps the
faster per phase, the CUDA kernels unless Triton is more than `MARGIN` faster (so timing
noise does not flip the choice between restarts). The measurement takes about a second at
start-up (Triton compiles its variants then) and is logged, so the choice follows the GPU
instead of a rule written for another one. A kernel that fails to build or run here is
dropped with a warning; with none left the engine runs the torch reference.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pagedrs.attention import triton_attention
from pagedrs.attention.cuda_backend import KERNELS, CudaAttentionMetadata, KernelPlan, cuda_supports
from pagedrs.kernels import cuda as cuda_kernels
from pagedrs.kernels import triton as triton_runtime

logger = logging.getLogger(__name__)

DECODE_SHAPE = (32, 1024)
"""Decode batch timed by `choose_plan`: sequences x context tokens."""
PREFILL_SHAPE = (512, 512)
"""Prefill chunk timed by `choose_plan`: chunk tokens x cached prefix tokens."""

MARGIN = 0.05
"""How much faster (a fraction) Triton must measure to replace the CUDA kernels in a phase."""

Timer = Callable[[Callable[[], object]], float]


def why_not(kernel: str, head_dim: int, num_heads: int, num_kv_heads: int, block_size: int) -> str | None:
    """Why ``kernel`` cannot run this attention shape here, or ``None`` if it can."""
    if kernel == "cuda":
        return cuda_supports(head_dim, num_heads, num_kv_heads)
    if not triton_runtime.available():
        return "Triton is not installed"
    return triton_attention.supports(head_dim, block_size)


def time_on_gpu(fn: Callable[[], object], repeats: int = 10) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after a warm-up, by CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


def synthetic_step(
    num_seqs: int,
    query_len: int,
    context: int,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    shuffle: bool = False,
) -> tuple[dict[str, Any], tuple]:
    """A step of ``num_seqs`` sequences each computing its last ``query_len`` of ``context``
    tokens over a random paged cache (their blocks one after another, or in a random order
    with ``shuffle``): (the metadata's ``build`` arguments, ``attend``'s arguments)."""
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = num_seqs * blocks_per_seq
    order = np.random.default_rng(0).permutation(num_blocks) if shuffle else np.arange(num_blocks)
    block_tables = order.astype(np.int32).reshape(num_seqs, blocks_per_seq)
    positions = np.tile(np.arange(context - query_len, context), num_seqs)
    seq_of_row = np.repeat(np.arange(num_seqs), query_len)
    slot_mapping = block_tables[seq_of_row, positions // block_size].astype(np.int64) * block_size
    step = dict(
        positions=positions,
        slot_mapping=slot_mapping + positions % block_size,
        query_start_loc=np.arange(num_seqs + 1, dtype=np.int32) * query_len,
        context_lens=np.full(num_seqs, context, dtype=np.int32),
        block_tables=block_tables,
        block_size=block_size,
        sliding_window=None,
        device=device,
    )
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    rows = num_seqs * query_len
    key = torch.randn(rows, num_kv_heads, head_dim, device=device).to(dtype)
    attend = (
        torch.randn(rows, num_heads, head_dim, device=device).to(dtype),
        key,
        torch.randn_like(key),
        torch.randn(cache_shape, device=device).to(dtype),
        torch.randn(cache_shape, device=device).to(dtype),
        head_dim**-0.5,
    )
    return step, attend


def measure(
    kernels: list[str],
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    timer: Timer,
) -> dict[tuple[str, str], float]:
    """Seconds per launch of each kernel on each phase: ``{(phase, kernel): seconds}``. Every
    kernel is timed with the same key/value write (the CUDA one when CUDA is among them, as a
    mixed plan runs it), so only the attention differs. A kernel that raises is left out."""
    if "cuda" in kernels:
        try:
            cuda_kernels.load()  # built before it is timed
        except Exception as error:  # noqa: BLE001 - nvcc missing or failing: say why, go on without it
            logger.warning("attention kernels: the CUDA kernels are left out: %s", error)
            kernels = [k for k in kernels if k != "cuda"]
    results = {}
    for phase, (num_seqs, query_len, context) in {
        "decode": (DECODE_SHAPE[0], 1, DECODE_SHAPE[1]),
        "prefill": (1, PREFILL_SHAPE[0], sum(PREFILL_SHAPE)),
    }.items():
        step, inputs = synthetic_step(
            num_seqs, query_len, context, block_size, num_heads, num_kv_heads, head_dim, dtype, device
        )
        for kernel in kernels:
            plan = KernelPlan(kernel, kernel, num_heads, num_kv_heads, head_dim)
            meta = CudaAttentionMetadata.build(**step, plan=plan)
            meta.cuda_writes = "cuda" in kernels
            try:
                results[(phase, kernel)] = timer(functools.partial(meta.attend, *inputs))
            except Exception as error:  # noqa: BLE001 - a compile or launch failure on this GPU
                logger.warning(
                    "attention kernels: %s failed on the %s timing and is left out: %s", kernel, phase, error
                )
    return results


def choose_plan(
    requested: str,
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    timer: Timer | None = None,
) -> KernelPlan | None:
    """The kernels for each phase: ``requested`` ``"cuda"`` or ``"triton"`` for both, or
    (``"auto"``) the faster of those that support the shape, measured with ``timer``;
    ``None`` when no kernel ran in the measurement (the caller uses the torch reference)."""
    shape = (num_heads, num_kv_heads, head_dim)
    if requested in KERNELS:
        return KernelPlan(requested, requested, *shape)
    usable = [k for k in KERNELS if why_not(k, head_dim, num_heads, num_kv_heads, block_size) is None]
    if not usable:
        raise ValueError("no GPU attention kernel supports this model: use attention_backend='torch'")
    if len(usable) == 1:
        return KernelPlan(usable[0], usable[0], *shape)
    seconds = measure(usable, device, dtype, num_heads, num_kv_heads, head_dim, block_size, timer or time_on_gpu)
    best = {}
    for phase in ("decode", "prefill"):
        ran = {kernel: s for (p, kernel), s in seconds.items() if p == phase}
        if not ran:
            logger.warning("attention kernels: none ran on the %s timing; using the torch reference", phase)
            return None
        best[phase] = min(ran, key=ran.__getitem__)
        if best[phase] == "triton" and "cuda" in ran and ran["triton"] > ran["cuda"] * (1 - MARGIN):
            best[phase] = "cuda"
    logger.info(
        "attention kernels: decode %s, prefill %s (%s)",
        best["decode"],
        best["prefill"],
        ", ".join(f"{phase} {kernel} {s * 1e6:.0f} us" for (phase, kernel), s in seconds.items()),
    )
    return KernelPlan(best["decode"], best["prefill"], *shape)
