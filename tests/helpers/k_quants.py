"""Random k-quant weights (Q4_K, Q6_K), which ``gguf.quants`` cannot quantize to:
- ``K_QUANTS``: the k-quant types the kernels take.
- `random_k_blocks`: packed rows of random blocks with finite scales."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

K_QUANTS = [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K]


def random_k_blocks(
    qtype,
    out_features: int,
    in_features: int,
    seed: int,
    scale_range: tuple[float, float] = (0.001, 0.02),
    centred: bool = False,
) -> np.ndarray:
    """Packed rows of random k-quant blocks: random quants and sub-block scales (Q4_K: every
    6-bit scale and minimum), fp16 super-scales (Q4_K: ``d`` and ``dmin`` apart) drawn from
    ``scale_range`` (random bytes there could be inf or NaN). ``centred`` (for a model that
    should say something): Q4_K sub-block scales ``sc`` in 1..8 with minimums ``round(7.5 sc)``
    and ``dmin = d``, so that ``w = d sc q - d m`` is about ``d sc (q - 7.5)``, not all of one
    sign."""
    generator = np.random.default_rng(seed)
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    num_blocks = out_features * in_features // block_weights
    blocks = generator.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8)
    d = generator.uniform(*scale_range, num_blocks).astype(np.float16).view(np.uint8).reshape(num_blocks, 2)
    if qtype == GGMLQuantizationType.Q6_K:
        blocks[:, 208:210] = d
        return blocks.reshape(out_features, -1)
    blocks[:, 0:2] = d
    if not centred:
        dmin = generator.uniform(*scale_range, num_blocks).astype(np.float16)
        blocks[:, 2:4] = dmin.view(np.uint8).reshape(num_blocks, 2)
        return blocks.reshape(out_features, -1)  # random bytes: every 6-bit scale and minimum
    blocks[:, 2:4] = d
    sc = generator.integers(1, 9, (num_blocks, 8)).astype(np.uint8)
    m = np.round(sc * 7.5).astype(np.uint8)
    # ggml's 12-byte packing of eight 6-bit scales and minimums (get_scale_min_k4's inverse).
    scales = np.zeros((num_blocks, 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    blocks[:, 4:16] = scales
    return blocks.reshape(out_features, -1)
