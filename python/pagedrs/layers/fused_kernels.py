"""Triton kernels of `pagedrs.layers.fused` (imported on first use, so importing pagedrs never
imports Triton). A program takes one token row; ``BLOCK`` is the row width padded to a power
of two. The arithmetic follows the Hugging Face reference step by step, rounding to the model's
dtype where it rounds, so a float32 model matches it and a bf16 one rounds the same way."""

import triton
import triton.language as tl


@triton.jit
def add_rms_norm(
    x_ptr,  # [num_tokens, hidden]: the layer's input (the residual stream)
    delta_ptr,  # [num_tokens, hidden]: what the sublayer adds to it (ignored without HAS_DELTA)
    weight_ptr,  # [hidden]
    residual_out_ptr,  # [num_tokens, hidden]: x + delta, in the model's dtype
    out_ptr,  # [num_tokens, hidden]: RMSNorm(x + delta)
    hidden,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * hidden + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)  # the residual add rounds
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf * (1.0 / tl.sqrt(variance + eps))).to(x.dtype)  # rounded before the weight
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * hidden + cols, out, mask=mask)


@triton.jit
def silu_and_mul(
    gate_up_ptr,  # [num_tokens, 2 * intermediate]: gate then up
    out_ptr,  # [num_tokens, intermediate]
    intermediate,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(gate_up_ptr + row * 2 * intermediate + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * intermediate + intermediate + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu rounds to the dtype
    out = (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * intermediate + cols, out, mask=mask)


@triton.jit
def grouped_matmul(
    x_ptr,  # [num_sources, K]: the rows the grouped rows read
    w_ptr,  # [E, N, K]: each expert's matrix, rows are outputs
    out_ptr,  # [num_grouped, N]
    source_ptr,  # [num_grouped] int64: the x row of each grouped row (-1: padding)
    block_expert_ptr,  # [num_grouped / BLOCK_M] int64: the expert of each block of grouped rows
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[r] = x[source[r]] @ W_e^T for the BLOCK_M grouped rows of one expert and BLOCK_N of
    its outputs: a mixture's experts as one launch (vLLM's fused-MoE shape). Rows are grouped by
    expert and each expert's run padded to whole blocks, so a block reads one expert's weights."""
    block_m = tl.program_id(0).to(tl.int64)
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(block_expert_ptr + block_m)
    sources = tl.load(source_ptr + rows)
    valid = sources >= 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + sources[:, None] * K + ks[None, :], mask=valid[:, None] & (ks[None, :] < K), other=0.0)
        b = tl.load(
            w_ptr + expert * N * K + cols[None, :] * K + ks[:, None],
            mask=(cols[None, :] < N) & (ks[:, None] < K),
            other=0.0,
        )
        acc += tl.dot(a, b, input_precision="ieee")
    tl.store(
        out_ptr + rows[:, None] * N + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & (cols[None, :] < N),
    )
