"""GGUF block formats the CPU kernel runs on (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K): their sizes, and
dequantize / quantize in torch, computing exactly what ``gguf.quants`` computes in float32.

A packed weight row of ``in_features`` weights is ``in_features / block_weights`` blocks. Q8_0,
Q4_0 and Q4_1 blocks hold 32 weights: an fp16 scale ``d`` (Q4_1: and an fp16 minimum ``m``)
then the 32 quants: Q8_0 int8 ``q`` (``w = d q``), Q4_0 and Q4_1 16 bytes of nibbles, weight
``j`` in the low half of byte ``j`` and weight ``j + 16`` in its high half (``w = d (q - 8)``,
``w = d q + m``). The k-quants Q4_K and Q6_K hold 256 weights a block, with scales of every 32
or 16 (their layouts: ``cpu/quant_matmul.cpp``); they dequantize through ``gguf.quants``.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

BLOCK_SIZE = 32
"""Weights per block of Q8_0, Q4_0 and Q4_1, along the input features."""

KERNEL_TYPES = (
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q6_K,
)
"""The formats ``torch.ops.pagedrs_cpu.quant_matmul`` multiplies by without dequantizing."""

K_QUANTS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K)


def block_weights(ggml_type: GGMLQuantizationType) -> int:
    """Weights of one block, along the input features (32; 256 for the k-quants)."""
    return GGML_QUANT_SIZES[ggml_type][0]


def block_bytes(ggml_type: GGMLQuantizationType) -> int:
    return GGML_QUANT_SIZES[ggml_type][1]


def fits_blocks(ggml_type: GGMLQuantizationType, in_features: int) -> bool:
    """Whether ``in_features`` weights are whole blocks of ``ggml_type``."""
    return in_features % block_weights(ggml_type) == 0


def row_bytes(ggml_type: GGMLQuantizationType, in_features: int) -> int:
    """Bytes of one packed row of ``in_features`` weights."""
    if not fits_blocks(ggml_type, in_features):
        raise ValueError(
            f"{in_features} input features are not a multiple of {ggml_type.name}'s block of {block_weights(ggml_type)}"
        )
    return in_features // block_weights(ggml_type) * block_bytes(ggml_type)


def dequantize(packed: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """float32 ``[rows, in_features]`` of packed uint8 rows ``[rows, row_bytes]``."""
    if ggml_type not in KERNEL_TYPES:
        raise ValueError(f"dequantize in torch supports {[t.name for t in KERNEL_TYPES]}, not {ggml_type.name}")
    if ggml_type in K_QUANTS:
        return torch.from_numpy(gguf_quants.dequantize(packed.numpy(), ggml_type))
    rows = packed.shape[0]
    blocks = packed.reshape(rows, -1, block_bytes(ggml_type))
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    if ggml_type == GGMLQuantizationType.Q8_0:
        out = blocks[..., 2:].contiguous().view(torch.int8).float() * d
    else:
        quants = blocks[..., 4:] if ggml_type == GGMLQuantizationType.Q4_1 else blocks[..., 2:]
        nibbles = torch.cat([quants & 0x0F, quants >> 4], dim=-1)
        if ggml_type == GGMLQuantizationType.Q4_0:
            out = d * (nibbles.to(torch.int8) - 8).float()
        else:
            m = blocks[..., 2:4].contiguous().view(torch.float16).float()
            out = d * nibbles.float() + m
    return out.reshape(rows, -1)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """Packed Q8_0 rows ``[rows, in_features / 32 * 34]`` of a float ``[rows, in_features]``:
    ``d = max |w| / 127`` per block (stored as fp16), ``q = round(w / d)``, as llama.cpp's
    reference quantizer (and ``gguf.quants``) compute them."""
    rows, in_features = weight.shape
    if in_features % BLOCK_SIZE != 0:
        raise ValueError(f"{in_features} input features are not a multiple of the block size {BLOCK_SIZE}")
    blocks = weight.float().reshape(rows, -1, BLOCK_SIZE)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse
    # roundf: halves away from zero (torch.round rounds them to even).
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int8)
    packed = torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], dim=-1)
    return packed.reshape(rows, -1)
