"""The Triton paged-attention kernels (`pagedrs.attention.triton_attention`) against the torch
reference. Here they run through Triton's interpreter on CPU tensors, the same kernel source
that the GPU compiles, so every machine checks their indexing, masks, tiling and split-K
merge; outputs are poisoned (NaN) first so an unwritten element shows. `make gpu-check` runs
this file again on a GPU (compiled kernels, bfloat16 too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedrs.attention import triton_attention
from pagedrs.attention.torch_ref import write_kv
from pagedrs.kernels import triton as triton_runtime
from tests.helpers.batches import Batch

if not triton_runtime.available():
    pytest.skip("Triton is not installed here (it comes with torch's CUDA wheels)", allow_module_level=True)

pytestmark = pytest.mark.slow  # Triton's interpreter on the CPU; make gpu-check compiles them

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter cannot multiply bfloat16 tiles (tl.dot); a GPU can.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _run(
    batch: Batch, decode: bool, num_segments: int = 1, sliding_window: int = 0, softcap: float = 0.0
) -> torch.Tensor:
    """The batch through the Triton kernels: keys/values written, every row attended."""
    write_kv(
        batch.key, batch.value, batch.key_cache, batch.value_cache, torch.from_numpy(batch.slot_mapping).to(DEVICE)
    )
    num_heads, num_kv_heads = batch.query.shape[1], batch.key_cache.shape[2]
    config = triton_attention.tile_config(num_heads // num_kv_heads, batch.query.shape[2], decode=decode)
    tile_seqs, tile_rows = triton_attention.query_tiles(batch.query_start_loc, config.tile_tokens)
    block_tables, cu_seqlens, context_lens = batch.device_arrays()
    out = torch.full_like(batch.query, float("nan"))
    triton_attention.paged_attention(
        out,
        batch.query,
        batch.key_cache,
        batch.value_cache,
        block_tables,
        cu_seqlens,
        context_lens,
        torch.from_numpy(tile_seqs).to(DEVICE),
        torch.from_numpy(tile_rows).to(DEVICE),
        batch.scale,
        sliding_window,
        config,
        num_segments,
        softcap,
    )
    return out


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(actual).any(), "the kernel left elements unwritten (NaN poison survived)"
    error = ((actual.float() - expected.float()).abs() / (expected.float().abs() + 1)).max().item()
    assert error <= TOLERANCE[dtype], f"relative error {error:.2e} > {TOLERANCE[dtype]:.0e}"


def _reference(batch: Batch, sliding_window: int = 0) -> torch.Tensor:
    return batch.reference(sliding_window or None)


HEADS = {"mha": (4, 4), "gqa3": (6, 2), "gqa4": (8, 2), "mqa16": (16, 1)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("heads", list(HEADS), ids=str)
@pytest.mark.parametrize("num_segments", [1, 4])
def test_decode_matches_reference(dtype, head_dim, heads, num_segments):
    num_heads, num_kv_heads = HEADS[heads]
    contexts = [1, 17, 100, 300]
    batch = Batch(contexts, [1] * len(contexts), num_heads, num_kv_heads, head_dim, 16, dtype, device=DEVICE)
    _assert_close(_run(batch, decode=True, num_segments=num_segments), _reference(batch), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", ["gqa3", "gqa4", "mqa16"])
def test_prefill_chunks_over_a_cached_prefix_match_reference(dtype, head_dim, block_size, heads):
    """Chunks with and without a cached prefix, shorter and longer than a tile (a tile holds
    64 rows: 16 tokens of gqa4, 4 of mqa16), mixed with decode rows in one launch."""
    num_heads, num_kv_heads = HEADS[heads]
    contexts, queries = [40, 150, 7, 90, 33], [40, 37, 7, 1, 16]
    batch = Batch(contexts, queries, num_heads, num_kv_heads, head_dim, block_size, dtype, device=DEVICE)
    _assert_close(_run(batch, decode=False), _reference(batch), dtype)


@pytest.mark.parametrize("window", [1, 5, 64])
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("num_segments", [1, 4])
def test_sliding_window(window, decode, num_segments):
    """Windows shorter than a key tile, than the context, and one of a single token; in
    split-K some parts lie wholly before the window and must weigh nothing."""
    contexts = [300, 50, 3, 129]
    queries = [1] * 4 if decode else [20, 50, 3, 1]
    batch = Batch(contexts, queries, 8, 2, 64, 16, torch.float32, seed=3, device=DEVICE)
    out = _run(batch, decode=decode, num_segments=num_segments, sliding_window=window)
    _assert_close(out, _reference(batch, window), torch.float32)


@pytest.mark.parametrize("decode", [True, False])
def test_softcap_matches_the_reference(decode):
    """Gemma 2's softcap (scores capped at +-softcap by tanh) with a window, as its layers run."""
    contexts = [70, 20, 130]
    queries = [1] * 3 if decode else [20, 20, 1]
    batch = Batch(contexts, queries, 8, 2, 64, 16, torch.float32, seed=5, device=DEVICE)
    batch.scale = 2.0  # large scores, so the cap bends them
    out = _run(batch, decode=decode, num_segments=2, sliding_window=16, softcap=5.0)
    _assert_close(out, batch.reference(16, softcap=5.0), torch.float32)
    assert not torch.allclose(out, batch.reference(16), atol=1e-3)  # the cap changed the result


def test_split_k_parts_past_a_short_context_weigh_nothing():
    """Eight parts over contexts of 1 to 40 tokens: most parts of most rows are empty."""
    contexts = [1, 2, 40, 17]
    batch = Batch(contexts, [1] * 4, 8, 2, 64, 16, torch.float32, seed=4, device=DEVICE)
    _assert_close(_run(batch, decode=True, num_segments=8), _reference(batch), torch.float32)


def test_query_tiles_cut_each_sequence():
    cu = np.array([0, 5, 5, 6, 22], dtype=np.int32)  # lengths 5, 0, 1, 16
    tile_seqs, tile_rows = triton_attention.query_tiles(cu, 4)
    assert tile_seqs.tolist() == [0, 0, 2, 3, 3, 3, 3]
    assert tile_rows.tolist() == [0, 4, 5, 6, 10, 14, 18]


def test_segments_fill_the_gpu_only_for_small_launches():
    assert triton_attention.num_segments_for(256, 8, 2048, 64) == 1  # 2048 programs already
    assert triton_attention.num_segments_for(1, 8, 32768, 64) == 64
    assert triton_attention.num_segments_for(8, 8, 32768, 64) == 8
    assert triton_attention.num_segments_for(4, 3, 200, 64) == 1  # too short to cut
    for args in [(3, 3, 5000, 64), (1, 1, 100000, 32), (7, 2, 700, 64)]:
        parts = triton_attention.num_segments_for(*args)
        assert parts & (parts - 1) == 0 and 1 <= parts <= 64 and parts * args[0] * args[1] <= 512


def test_tiny_heads_are_padded_for_tl_dot():
    """Head size 8: the dot's K padded to 16 (a GPU's least), the padding masked."""
    batch = Batch([5, 40], [1, 1], 4, 2, 8, 16, torch.float32, seed=5, device=DEVICE)
    _assert_close(_run(batch, decode=True), _reference(batch), torch.float32)


def test_unsupported_shapes_are_named():
    assert triton_attention.supports(128, 16) is None
    assert "block size 24" in triton_attention.supports(128, 24)
    assert "head size 512" in triton_attention.supports(512, 16)
