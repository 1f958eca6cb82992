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


def _nothing():
    import contextlib

    return contextlib.nullcontext()
