"""Paged attention in Triton: one kernel for decode rows and prefill chunks, with tensor cores.

Dimension names (as in ``cuda/ops.h``)::

    query / out          [num_rows, num_heads, head_dim]
    key / value cache    [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables         [num_seqs, max_blocks_per_seq]  int32
    cu_seqlens_q         [num_seqs + 1]  int32   rows of sequence s: cu[s] .. cu[s + 1]
    context_lens         [num_seqs]      int32   the rows are the last tokens of the context

A program takes one *query tile* of one KV head: up to ``tile_tokens`` consecutive query
tokens of one sequence times the ``group`` query heads that share the KV head, flattened into
the ``BLOCK_M`` rows of a matrix (row ``r`` is token ``r // GROUP_PAD``, head
``r % GROUP_PAD``). So a decode row's group of heads, or a prefill chunk's tokens x heads,
multiply each key/value tile once, with ``tl.dot`` (tensor cores on sm_80+):

    scores[BLOCK_M, BLOCK_N] = Q[BLOCK_M, D] @ K[BLOCK_N, D]^T   (masked: causal, window)
    acc[BLOCK_M, D]         += softmax numerators @ V[BLOCK_N, D]  (online softmax)

The key/value tile gathers ``BLOCK_N`` tokens by slot (block table entry x block size +
offset, with the block size a compile-time power of two: shifts, no division), each token's
head row contiguous, which Triton loads 16 bytes at a time.

Split-K ("segments"): a decode batch has too few tiles to fill a GPU, so each tile's context
is cut into ``num_segments`` equal parts (per sequence, from its own context length, so the
launch shape does not depend on the step: the same grid serves a CUDA graph's every replay),
each part written unnormalised to a workspace with its running max and sum, then merged:
``out = sum_p w_p out_p / sum_p w_p`` with ``w_p = sum_p exp(max_p - max)``.

The same kernels run on CPU tensors through Triton's interpreter (NumPy, slow; set
``TRITON_INTERPRET=1`` before Triton is imported, as the tests do without a GPU), which is
how `make test` checks them against the torch reference on a machine without a GPU. The
interpreter mishandles ``tl.dot`` on bfloat16 inputs, so there the tests use float32 and
float16; bfloat16 is checked on a GPU (``make gpu-check``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from pagedrs.kernels.triton import interpreting

MAX_HEAD_DIM = 256


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def supports(head_dim: int, block_size: int) -> str | None:
    """Why these kernels cannot run a cache of this shape, or ``None`` if they can."""
    if head_dim > MAX_HEAD_DIM:
        return f"head size {head_dim} (the Triton kernels take up to {MAX_HEAD_DIM})"
    if block_size & (block_size - 1):
        return f"block size {block_size} (the Triton kernels take powers of two)"
    return None


@dataclass(frozen=True)
class TileConfig:
    """How one launch cuts its rows into tiles."""

    block_m: int
    block_n: int
    group_pad: int

    @property
    def tile_tokens(self) -> int:
        """Query tokens of one sequence per tile."""
        return self.block_m // self.group_pad


def tile_config(group: int, head_dim: int, decode: bool) -> TileConfig:
    """Decode: one token per tile (the group's heads fill the rows, padded to 16, tl.dot's
    least). Prefill: 64 rows of tokens x heads (32 for heads over 128 wide, to stay in
    shared memory)."""
    group_pad = _next_power_of_2(group)
    if decode:
        block_m = max(16, group_pad)
    else:
        block_m = max(64 if head_dim <= 128 else 32, group_pad)
    block_n = 64 if head_dim <= 128 else 32
    return TileConfig(block_m=block_m, block_n=block_n, group_pad=group_pad)


def query_tiles(cu_seqlens_q: np.ndarray, tile_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tile_seqs, tile_rows)``: for each tile, its sequence and first query row; each
    sequence's rows cut into tiles of ``tile_tokens``. ``int32 [num_tiles]`` each."""
    lengths = np.diff(cu_seqlens_q).astype(np.int64)
    tiles_per_seq = -(-lengths // tile_tokens)
    tile_seqs = np.repeat(np.arange(len(lengths), dtype=np.int32), tiles_per_seq)
    first_tile = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(tiles_per_seq, out=first_tile[1:])
    index_in_seq = np.arange(len(tile_seqs), dtype=np.int64) - first_tile[tile_seqs]
    tile_rows = (cu_seqlens_q[:-1].astype(np.int64)[tile_seqs] + index_in_seq * tile_tokens).astype(np.int32)
    return tile_seqs, tile_rows


def num_segments_for(num_tiles: int, num_kv_heads: int, max_context_len: int, block_n: int) -> int:
    """Split-K parts for a launch: when tiles x KV heads are too few to fill a large GPU (512
    programs: ~4 per SM of an H100/H200), enough parts to get there, each at least two key
    tiles of the longest context, at most 64; a power of two (the merge kernel's arange).
    Each sequence cuts its own context into that many parts (short ones leave parts empty),
    so a caller that needs one grid per batch size (a CUDA graph) may pass any fixed count
    instead; each count is one compiled variant (at most 7)."""
    programs = num_tiles * num_kv_heads
    wanted = min(-(-512 // max(programs, 1)), max_context_len // (2 * block_n), 64)
    if wanted <= 1:
        return 1
    return 1 << (wanted.bit_length() - 1)  # the power of two at or below


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    tile_seqs: torch.Tensor,
    tile_rows: torch.Tensor,
    scale: float,
    sliding_window: int,
    config: TileConfig,
    num_segments: int = 1,
    softcap: float = 0.0,
) -> None:
    """Writes ``out`` (``[num_rows, num_heads, head_dim]``) for the rows the tiles cover. With
    split-K, the parts go through a float32 workspace allocated here (inside a CUDA graph's
    capture, from the graph's pool)."""
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    if num_rows == 0 or len(tile_seqs) == 0:
        return
    from pagedrs.attention import triton_kernels

    if query.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"the Triton kernels run on CUDA tensors (got {query.device}), or on the CPU with TRITON_INTERPRET=1 "
            "set before Triton is imported"
        )
    attention, merge = triton_kernels.attention, triton_kernels.merge
    target, maxes, sums = out, out, out  # unused without split-K
    if num_segments > 1:
        shape = (num_rows, num_heads, num_segments)
        target = torch.empty((*shape, head_dim), dtype=torch.float32, device=query.device)
        maxes = torch.empty(shape, dtype=torch.float32, device=query.device)
        sums = torch.empty(shape, dtype=torch.float32, device=query.device)
    head_pad = max(16, _next_power_of_2(head_dim))  # tl.dot's least K on a GPU
    grid = (len(tile_seqs), num_kv_heads, num_segments)
    # Triton launches on the current device: make it the tensors' (an engine on cuda:1).
    device_scope = torch.cuda.device(query.device) if query.device.type == "cuda" else contextlib.nullcontext()
    with device_scope:
        attention[grid](
            target,
            maxes,
            sums,
            query,
            key_cache,
            value_cache,
            block_tables,
            cu_seqlens_q,
            context_lens,
            tile_seqs,
            tile_rows,
            scale,
            sliding_window,
            softcap,
            block_tables.shape[1],
            num_heads,
            num_kv_heads,
            group,
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
            BLOCK_SIZE=block_size,
            GROUP_PAD=config.group_pad,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            NUM_SEGMENTS=num_segments,
            IEEE=query.dtype == torch.float32,
        )
        if num_segments > 1:
            merge[(num_rows * num_heads,)](
                out, target, maxes, sums, HEAD_DIM=head_dim, HEAD_PAD=head_pad, NUM_SEGMENTS=num_segments
            )
