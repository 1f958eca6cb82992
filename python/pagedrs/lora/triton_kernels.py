"""Triton kernels of the batched LoRA update (`pagedrs.lora.slots`), imported on first use. A
program takes one token row (BGMV's shape: each row reads its own adapter's slot), so rows of
different adapters share a launch and rows without one return at once. Sums in float32."""

import triton
import triton.language as tl


@triton.jit
def lora_shrink(
    x_ptr,  # [num_tokens, K]
    a_ptr,  # [slots, slices, R, K]
    slot_ptr,  # [num_tokens] int64: each row's slot, -1 for none
    out_ptr,  # [num_tokens, slices, R] float32
    K,
    R,
    slices,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[t, j] = A[slot(t), j] @ x[t] for slice j = program_id(1)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + row)
    if slot < 0:
        return
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    base = a_ptr + ((slot * slices + part) * R) * K
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * K + ks, mask=ks < K, other=0.0).to(tl.float32)
        a = tl.load(base + ranks[:, None] * K + ks[None, :], mask=(ranks[:, None] < R) & (ks[None, :] < K), other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + (row * slices + part) * R + ranks, acc, mask=ranks < R)


@triton.jit
def lora_expand(
    shrunk_ptr,  # [num_tokens, slices, R] float32
    b_ptr,  # [slots, R, N]: one slice's B, transposed
    slot_ptr,  # [num_tokens] int64
    y_ptr,  # [num_tokens, width]: the linear's output, updated in place
    part,
    slices,
    R,
    N,
    width,
    start,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """y[t, start + n] += B[slot(t)][n] . shrunk[t, part] for BLOCK_N outputs n."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row)
    if slot < 0:
        return
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    shrunk = tl.load(shrunk_ptr + (row * slices + part) * R + ranks, mask=ranks < R, other=0.0)
    b = tl.load(
        b_ptr + (slot * R + ranks[None, :]) * N + cols[:, None],
        mask=(cols[:, None] < N) & (ranks[None, :] < R),
        other=0.0,
    )
    update = tl.sum(b.to(tl.float32) * shrunk[None, :], axis=1)
    where = y_ptr + row * width + start + cols
    y = tl.load(where, mask=cols < N, other=0.0)
    tl.store(where, (y.to(tl.float32) + update).to(y.dtype), mask=cols < N)
