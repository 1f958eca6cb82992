"""The Triton kernels of `pagedrs.attention.triton_attention` (see its docstring for the
layout and the algorithm). Kept apart so that importing pagedrs never imports Triton: this
module is imported on the first launch. With ``TRITON_INTERPRET=1`` in the environment
before Triton is first imported, the same source runs on CPU tensors (NumPy), which is how
the tests check it without a GPU."""

import triton
import triton.language as tl

# The stand-in for "minus infinity" in a running max must be finite: a row with no key in a
# segment keeps max = NEG_LARGE, and exp(NEG_LARGE - NEG_LARGE) = 1 instead of NaN.
NEG_LARGE: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit(do_not_specialize=["sliding_window", "softcap", "max_blocks_per_seq"])
def attention(
    out_ptr,  # [num_rows, num_heads, head_dim], or the segment workspace
    max_ptr,  # [num_rows, num_heads, num_segments] float32 (segments only)
    sum_ptr,  # [num_rows, num_heads, num_segments] float32 (segments only)
    query_ptr,  # [num_rows, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    context_lens_ptr,  # [num_seqs] int32
    tile_seqs_ptr,  # [num_tiles] int32: the sequence of each query tile
    tile_rows_ptr,  # [num_tiles] int32: the first query row of each tile
    scale,
    sliding_window,  # 0: none
    softcap,  # 0: none; else scores become softcap * tanh(score / softcap) (Gemma 2)
    max_blocks_per_seq,
    num_heads,
    num_kv_heads,
    group,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two
    BLOCK_SIZE: tl.constexpr,  # the cache's block size, a power of two
    GROUP_PAD: tl.constexpr,  # next power of two of group
    BLOCK_M: tl.constexpr,  # rows of a tile (tokens x GROUP_PAD), >= 16
    BLOCK_N: tl.constexpr,  # key/value tokens per inner step, >= 16
    NUM_SEGMENTS: tl.constexpr,  # 1, or split-K parts (then out is the workspace)
    IEEE: tl.constexpr,  # float32 inputs multiply in full precision (not TF32)
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = tl.load(tile_seqs_ptr + tile)
    first_row = tl.load(tile_rows_ptr + tile)
    seq_end = tl.load(cu_seqlens_q_ptr + seq + 1)
    context = tl.load(context_lens_ptr + seq)

    r = tl.arange(0, BLOCK_M)
    token = r // GROUP_PAD
    head_in_group = r % GROUP_PAD
    row = first_row + token
    row_ok = (row < seq_end) & (head_in_group < group)
    head = kv_head * group + head_in_group
    # Position of each row's token in its sequence: the rows end the context.
    position = context - (seq_end - row)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM

    q_offsets = (row[:, None] * num_heads + head[:, None]) * HEAD_DIM + d[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Keys this tile can see: up to its last valid row's position, from the window start of its
    # first row; within this program's segment of the sequence's context.
    last_position = tl.max(tl.where(row_ok, position, -1), axis=0)
    first_position = tl.min(tl.where(row_ok, position, context), axis=0)
    lo = 0
    if sliding_window > 0:
        lo = tl.maximum(first_position - sliding_window + 1, 0)
    hi = last_position + 1
    if NUM_SEGMENTS > 1:
        segment_len = tl.cdiv(tl.cdiv(context, NUM_SEGMENTS), BLOCK_N) * BLOCK_N
        lo = tl.maximum(lo, segment * segment_len)
        hi = tl.minimum(hi, (segment + 1) * segment_len)
    start = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], NEG_LARGE, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq * max_blocks_per_seq
    for kv_start in range(start, hi, BLOCK_N):
        t = kv_start + n
        t_ok = t < hi
        block = tl.load(table + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + t % BLOCK_SIZE
        kv_offsets = (slot[:, None] * num_kv_heads + kv_head) * HEAD_DIM + d[None, :]
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale
        if softcap > 0:
            scores = softcap * (2 * tl.sigmoid(2 * scores / softcap) - 1)  # tanh
        visible = (t[None, :] <= position[:, None]) & (t[None, :] >= lo) & t_ok[None, :] & row_ok[:, None]
        if sliding_window > 0:
            visible = visible & (t[None, :] > position[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    store_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SEGMENTS > 1:
        # Workspace [num_rows, num_heads, NUM_SEGMENTS, HEAD_DIM]: normalised by this part's
        # sum (0 where the part saw no key), with the part's max and sum beside it.
        part = acc / tl.maximum(l_i, 1e-30)[:, None]
        row_head = row * num_heads + head
        offsets = (row_head[:, None] * NUM_SEGMENTS + segment) * HEAD_DIM + d[None, :]
        tl.store(out_ptr + offsets, part, mask=store_mask)
        tl.store(max_ptr + row_head * NUM_SEGMENTS + segment, m_i, mask=row_ok)
        tl.store(sum_ptr + row_head * NUM_SEGMENTS + segment, l_i, mask=row_ok)
    else:
        result = acc / tl.maximum(l_i, 1e-30)[:, None]  # padding rows: 0, not 0 / 0
        tl.store(out_ptr + q_offsets, result.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def merge(
    out_ptr,  # [num_rows, num_heads, head_dim]
    parts_ptr,  # [num_rows, num_heads, NUM_SEGMENTS, head_dim] float32
    max_ptr,  # [num_rows, num_heads, NUM_SEGMENTS] float32
    sum_ptr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two
    NUM_SEGMENTS: tl.constexpr,  # a power of two
):
    row_head = tl.program_id(0)
    s = tl.arange(0, NUM_SEGMENTS)
    d = tl.arange(0, HEAD_PAD)
    maxes = tl.load(max_ptr + row_head * NUM_SEGMENTS + s)
    sums = tl.load(sum_ptr + row_head * NUM_SEGMENTS + s)
    weights = sums * tl.exp(maxes - tl.max(maxes, axis=0))
    parts = tl.load(
        parts_ptr + (row_head * NUM_SEGMENTS + s[:, None]) * HEAD_DIM + d[None, :],
        mask=d[None, :] < HEAD_DIM,
        other=0.0,
    )
    result = tl.sum(parts * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + row_head * HEAD_DIM + d, result.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
