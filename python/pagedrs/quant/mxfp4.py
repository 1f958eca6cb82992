"""MXFP4 expert weights (gpt-oss's checkpoints, ``quant_method: mxfp4``), dequantized at load.

A tensor ``W [E, R, C]`` is stored as ``W_blocks`` uint8 ``[E, R, C / 32, 16]`` (32 FP4 e2m1
values per block, two a byte, the low nibble first) and ``W_scales`` uint8 ``[E, R, C / 32]``
(one power of two per block, e8m0: ``2 ** (scale - 127)``), and means ``W`` transposed, the
layout transformers' gpt-oss experts hold (``gate_up_proj [E, C, R]``). `Mxfp4Joiner` pairs the
two tensors as a checkpoint streams them and hands out the dequantized one under its own name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedrs.checkpoint import WeightHandle

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of an e2m1 nibble."""
SUFFIXES = ("_blocks", "_scales")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``W`` transposed (``[E, C, R]``) from ``blocks [E, R, C / 32, 16]`` and ``scales [E, R, C / 32]``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    if blocks.dim() != 4 or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks must be [experts, rows, groups, 16], got {tuple(blocks.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.empty(*blocks.shape[:-1], 32, dtype=torch.float32)
    values[..., 0::2] = lut[(blocks & 0x0F).long()]
    values[..., 1::2] = lut[(blocks >> 4).long()]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    experts, rows, groups, _ = blocks.shape
    return values.reshape(experts, rows, groups * 32).transpose(1, 2).to(dtype).contiguous()


class Mxfp4Joiner:
    """Pairs a checkpoint's ``X_blocks`` and ``X_scales`` tensors (in whichever order they come)
    and yields ``X`` dequantized once both are in; every other tensor passes through."""

    def __init__(self) -> None:
        self._pending: dict[str, dict[str, WeightHandle]] = {}

    def __call__(self, weights: Iterable[tuple[str, WeightHandle]]) -> Iterator[tuple[str, WeightHandle]]:
        for name, tensor in weights:
            suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
            if suffix is None:
                yield name, tensor
                continue
            base = name.removesuffix(suffix)
            parts = self._pending.setdefault(base, {})
            parts[suffix] = tensor
            if len(parts) == len(SUFFIXES):
                del self._pending[base]
                yield base, dequantize(parts["_blocks"][:], parts["_scales"][:])
        if self._pending:
            names = sorted(f"{base}{s}" for base, parts in self._pending.items() for s in SUFFIXES if s not in parts)
            raise ValueError(f"MXFP4 tensors without their other half: {names[:3]} missing")
