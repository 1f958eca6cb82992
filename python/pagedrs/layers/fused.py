"""Small per-layer ops fused into one kernel each on a GPU (Triton): the residual add with the
RMSNorm after it, and SiLU(gate) * up. Eagerly, a layer's two norms, two adds and activation
are about twenty kernel launches in torch; fused, four. A decode step replayed from a CUDA
graph pays no launch cost either way, so this is for eager steps (prefill chunks, and every
step under ``enforce_eager``).

`enabled` decides per tensor: CUDA tensors with Triton installed, unless `set_enabled(False)`
(`make gpu-check` times both). CPU tensors keep the torch ops (the CPU has its decoder stack),
except in tests, which force the kernels through Triton's interpreter.
"""

from __future__ import annotations

import torch

from pagedrs.kernels import triton as triton_runtime

_switch: bool | None = None
"""``None``: on for CUDA tensors; ``True``: on for every tensor (tests, interpreted on a
CPU); ``False``: off."""


def set_enabled(value: bool | None) -> None:
    """``None`` restores the default (CUDA tensors only)."""
    global _switch
    _switch = value


def enabled(x: torch.Tensor) -> bool:
    if _switch is False or not triton_runtime.available():
        return False
    return x.is_cuda or (_switch is True and triton_runtime.interpreting())


def _block(width: int) -> int:
    return 1 << max(width - 1, 0).bit_length()


def _warps(block: int) -> int:
    """Warps for a row of ``block`` elements: about 8 elements a thread (wide rows spill
    registers on the default 4 warps)."""
    return min(max(block // 256, 4), 16)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, RMSNorm(x + delta))`` (with ``delta`` None: ``(x, RMSNorm(x))``), rows
    ``[num_tokens, hidden]``, computed as `pagedrs.layers.norm.RMSNorm` after a residual add."""
    from pagedrs.layers import fused_kernels

    x = x.contiguous()
    num_tokens, hidden = x.shape
    residual = torch.empty_like(x) if delta is not None else x
    out = torch.empty_like(x)
    if num_tokens:
        with torch.cuda.device(x.device) if x.is_cuda else _nothing():
            fused_kernels.add_rms_norm[(num_tokens,)](
                x,
                x if delta is None else delta.contiguous(),
                weight,
                residual,
                out,
                hidden,
                eps,
                HAS_DELTA=delta is not None,
                BLOCK=_block(hidden),
                num_warps=_warps(_block(hidden)),
            )
    return residual, out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` of ``[num_tokens, 2 * intermediate]`` rows (gate first)."""
    from pagedrs.layers import fused_kernels

    gate_up = gate_up.contiguous()
    num_tokens, width = gate_up.shape
    intermediate = width // 2
    out = torch.empty(num_tokens, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    block = min(_block(intermediate), 1024)
    if num_tokens:
        with torch.cuda.device(gate_up.device) if gate_up.is_cuda else _nothing():
            fused_kernels.silu_and_mul[(num_tokens, -(-intermediate // block))](gate_up, out, intermediate, BLOCK=block)
    return out


GROUP_ROWS = 16
"""Rows of one expert a block of the grouped matmul takes (the smallest ``tl.dot`` tile)."""


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's (token, slot) pairs (``ids [T, K]``) grouped by expert, each expert's run padded
    to whole blocks of `GROUP_ROWS`: ``(slot of each grouped row (-1: padding), expert of each
    block, grouped row of each slot)``; experts without tokens take no block."""
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    blocks = (counts + GROUP_ROWS - 1) // GROUP_ROWS
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=ids.device), blocks)
    padded_start = (torch.cumsum(blocks, 0) - blocks) * GROUP_ROWS  # first grouped row of each expert
    order = torch.argsort(flat, stable=True)  # slots by expert
    start = torch.cumsum(counts, 0) - counts  # first sorted slot of each expert
    sorted_experts = flat[order]
    rank = torch.arange(flat.numel(), device=ids.device) - start[sorted_experts]
    row_of_slot = torch.empty_like(flat)
    row_of_slot[order] = padded_start[sorted_experts] + rank
    slots = torch.full((int(blocks.sum()) * GROUP_ROWS,), -1, dtype=torch.int64, device=ids.device)
    slots[row_of_slot] = torch.arange(flat.numel(), device=ids.device)
    return slots, block_expert, row_of_slot


def grouped_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """A mixture's routed experts (`pagedrs.layers.moe.experts_reference`'s result) as two
    grouped matmuls (Triton), one per projection over every active expert at once: rows grouped
    by expert, ``gate_up [E, 2I, H]``, the activation, ``down [E, H, I]``, then each token's
    weighted sum of its slots in slot order."""
    from pagedrs.layers import fused_kernels

    num_tokens, top_k = ids.shape
    num_experts, width, hidden = gate_up.shape
    x = x.contiguous()
    slots, block_expert, row_of_slot = group_by_expert(ids, num_experts)
    grouped = slots.numel()
    sources = torch.where(slots >= 0, slots // top_k, slots)
    gate_up_out = torch.empty(grouped, width, dtype=x.dtype, device=x.device)
    down_out = torch.empty(grouped, hidden, dtype=x.dtype, device=x.device)
    block_n, block_k = 32, 32
    with torch.cuda.device(x.device) if x.is_cuda else _nothing():
        if grouped:
            blocks = (grouped // GROUP_ROWS, -(-width // block_n))
            fused_kernels.grouped_matmul[blocks](
                x, gate_up.contiguous(), gate_up_out, sources, block_expert, width, hidden,
                BLOCK_M=GROUP_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
            )  # fmt: skip
            intermediate = width // 2
            if gate_up_bias is not None:  # each grouped row's expert's bias (padding rows: any)
                gate_up_out += gate_up_bias[block_expert].repeat_interleave(GROUP_ROWS, dim=0)
            activated = activation(gate_up_out[:, :intermediate], gate_up_out[:, intermediate:]).contiguous()
            own_rows = torch.where(slots >= 0, torch.arange(grouped, device=x.device), slots)
            blocks = (grouped // GROUP_ROWS, -(-hidden // block_n))
            fused_kernels.grouped_matmul[blocks](
                activated, down.contiguous(), down_out, own_rows, block_expert, hidden, intermediate,
                BLOCK_M=GROUP_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
            )  # fmt: skip
    if down_bias is not None and grouped:
        down_out += down_bias[block_expert].repeat_interleave(GROUP_ROWS, dim=0)
    per_slot = down_out[row_of_slot].view(num_tokens, top_k, hidden)
    out = torch.zeros_like(x)
    for k in range(top_k):  # slot order, as the CPU kernel adds them
        out += per_slot[:, k] * weights[:, k, None].to(x.dtype)
    return out


def _nothing():
    import contextlib

    return contextlib.nullcontext()
