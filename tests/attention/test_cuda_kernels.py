"""The CUDA kernels against the torch reference PagedAttention, on fresh random inputs, with
outputs poisoned (NaN) before each run so any element a kernel fails to write shows.

Without a CUDA device these skip: `make test` still compiles every kernel for sm_80 and
sm_90 (`make cuda-check`), and `make gpu-check` runs this file on a GPU."""

from __future__ import annotations

import pytest
import torch

from pagedrs.attention.torch_ref import write_kv
from tests.helpers.batches import Batch

if not torch.cuda.is_available():
    pytest.skip(
        "no CUDA device here: `make test` compiles the kernels (make cuda-check); `make gpu-check` runs these",
        allow_module_level=True,
    )

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def ops():
    from pagedrs.kernels.cuda import load

    return load()


def _assert_close(actual, expected, dtype):
    assert not torch.isnan(actual).any(), "the kernel left elements unwritten (NaN poison survived)"
    tolerance = TOLERANCE[dtype]
    error = ((actual.float() - expected.float()).abs() / (expected.float().abs() + 1)).max().item()
    assert error <= tolerance, f"relative error {error:.2e} > {tolerance:.0e}"


def _decode(ops, batch, sliding_window=0):
    block_tables, _, context_lens = batch.device_arrays()
    out = torch.full_like(batch.query, float("nan"))
    ops.paged_attention(
        out,
        batch.query,
        batch.key_cache,
        batch.value_cache,
        block_tables,
        context_lens,
        int(batch.context_lens.max()),
        batch.scale,
        sliding_window,
    )
    return out


def _prefill(ops, batch, sliding_window=0):
    block_tables, cu_seqlens, context_lens = batch.device_arrays()
    out = torch.full_like(batch.query, float("nan"))
    ops.paged_prefill_attention(
        out,
        batch.query,
        batch.key_cache,
        batch.value_cache,
        block_tables,
        cu_seqlens,
        context_lens,
        int(batch.context_lens.max()),
        batch.scale,
        sliding_window,
    )
    return out


# Ragged decode contexts: within one partition (1 token, a partial block, exactly 512), and
# past it (513: two partitions, 1500: three), which a decode batch runs split-K.
DECODE_CONTEXTS = {"one-partition": [1, 17, 100, 512], "split-k": [513, 1500, 40]}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (32, 2), (16, 1)], ids=["mha", "gqa4", "gqa16", "mqa16"])
@pytest.mark.parametrize("contexts", list(DECODE_CONTEXTS), ids=str)
def test_decode_matches_reference(ops, dtype, head_dim, block_size, heads, contexts):
    lengths = DECODE_CONTEXTS[contexts]
    batch = Batch(lengths, [1] * len(lengths), *heads, head_dim, block_size, dtype, seed=head_dim + block_size)
    expected = batch.reference()
    batch.write(ops)
    _assert_close(_decode(ops, batch), expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_many_decode_rows_walk_their_partitions(ops, dtype, head_dim):
    # More (row, KV head) pairs than split-K takes (300 x 8 > 2048): each block walks its
    # partitions with an online softmax instead.
    lengths = [600 + 3 * i for i in range(300)]
    batch = Batch(lengths, [1] * len(lengths), 32, 8, head_dim, 16, dtype, seed=5)
    expected = batch.reference()
    batch.write(ops)
    _assert_close(_decode(ops, batch), expected, dtype)


@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_long_prefill_walks_its_partitions(ops, window, head_dim):
    # 814 rows x 8 KV heads > 2048: no split-K; causal across partitions, with a window that
    # starts past the first partition.
    contexts, query_lens = [40, 300, 77, 9, 1100], [40, 64, 1, 9, 700]
    batch = Batch(contexts, query_lens, 32, 8, head_dim, 16, torch.float32, seed=9)
    expected = batch.reference(sliding_window=window or None)
    batch.write(ops)
    _assert_close(_prefill(ops, batch, window), expected, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_chunks_over_a_cached_prefix_match_reference(ops, dtype, head_dim, block_size):
    # Whole prompts, chunks after a cached prefix, a one-row chunk, a long chunk (split-K).
    contexts, query_lens = [40, 300, 77, 9, 1100], [40, 64, 1, 9, 700]
    batch = Batch(contexts, query_lens, 8, 2, head_dim, block_size, dtype, seed=7)
    expected = batch.reference()
    batch.write(ops)
    _assert_close(_prefill(ops, batch), expected, dtype)


def test_short_prefill_in_one_partition(ops):
    batch = Batch([40, 300, 77], [40, 64, 1], 8, 2, 128, 16, torch.float16, seed=8)
    expected = batch.reference()
    batch.write(ops)
    _assert_close(_prefill(ops, batch), expected, torch.float16)


@pytest.mark.parametrize("window", [8, 100, 600])
@pytest.mark.parametrize(
    "lengths", [([30, 700, 1300], [30, 1, 200]), ([30, 300, 500], [30, 1, 120])], ids=["partitions", "one-partition"]
)
def test_sliding_window_prefill(ops, window, lengths):
    batch = Batch(*lengths, 8, 4, 64, 16, torch.float32, seed=window)
    expected = batch.reference(sliding_window=window)
    batch.write(ops)
    _assert_close(_prefill(ops, batch, window), expected, torch.float32)


@pytest.mark.parametrize("window", [8, 100, 600])
def test_sliding_window_decode(ops, window):
    lengths = [5, 300, 512, 1300]
    batch = Batch(lengths, [1] * len(lengths), 8, 2, 128, 32, torch.float32, seed=window + 1)
    expected = batch.reference(sliding_window=window)
    batch.write(ops)
    _assert_close(_decode(ops, batch, window), expected, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_and_copy_blocks(ops, dtype):
    batch = Batch([50, 3, 33], [50, 1, 10], 4, 2, 128, 16, dtype, seed=3)
    # Keys and values as the model hands them over: views into one fused projection (a token
    # stride wider than a row), and a padding slot (-1) that must be skipped.
    fused = torch.cat([batch.key, batch.value], dim=1)
    key, value = fused[:, :2], fused[:, 2:]
    slots = torch.from_numpy(batch.slot_mapping).cuda()
    slots[5] = -1
    key_ref, value_ref = batch.key_cache.clone(), batch.value_cache.clone()
    keep = slots >= 0
    write_kv(key[keep].contiguous(), value[keep].contiguous(), key_ref, value_ref, slots[keep])
    ops.reshape_and_cache(key, value, batch.key_cache, batch.value_cache, slots)
    assert torch.equal(batch.key_cache, key_ref) and torch.equal(batch.value_cache, value_ref)
    pairs = torch.tensor([[1, 6], [4, 0]], dtype=torch.long, device="cuda")
    key_ref[pairs[:, 1]] = key_ref[pairs[:, 0]]
    value_ref[pairs[:, 1]] = value_ref[pairs[:, 0]]
    ops.copy_blocks(batch.key_cache, batch.value_cache, pairs)
    assert torch.equal(batch.key_cache, key_ref) and torch.equal(batch.value_cache, value_ref)


@pytest.mark.parametrize(
    "step", [([20, 700, 64, 1], [1, 300, 1, 1]), ([20, 700, 64], [1, 1, 1])], ids=["mixed", "decodes-only"]
)
def test_a_step_through_the_backend_matches_reference(ops, step):
    from pagedrs.attention.cuda_backend import CudaAttentionMetadata

    batch = Batch(*step, 9, 3, 64, 16, torch.float32, seed=11)
    expected = batch.reference()
    meta = CudaAttentionMetadata.build(
        positions=batch.positions,
        slot_mapping=batch.slot_mapping,
        query_start_loc=batch.query_start_loc,
        context_lens=batch.context_lens,
        block_tables=batch.block_tables,
        block_size=16,
        sliding_window=None,
        device=torch.device("cuda"),
    )
    out = meta.attend(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, batch.scale)
    _assert_close(out, expected, torch.float32)


def test_bad_inputs_fail_with_clear_messages(ops):
    batch = Batch([20], [1], 8, 2, 64, 16, torch.float32)
    block_tables, _, context_lens = batch.device_arrays()
    out = torch.empty_like(batch.query)
    with pytest.raises(RuntimeError, match="key_cache must be a CUDA tensor"):
        # Keys on the GPU (so the CUDA implementation runs), caches on the CPU.
        ops.reshape_and_cache(
            batch.key,
            batch.value,
            batch.key_cache.cpu(),
            batch.value_cache.cpu(),
            torch.zeros(1, dtype=torch.long, device="cuda"),
        )
    with pytest.raises(RuntimeError, match="head sizes 64 and 128"):
        cache = torch.zeros(4, 16, 2, 96, device="cuda")
        ops.paged_attention(
            torch.zeros(1, 8, 96, device="cuda"),
            torch.zeros(1, 8, 96, device="cuda"),
            cache,
            cache,
            block_tables,
            context_lens,
            20,
            1.0,
            0,
        )
    with pytest.raises(RuntimeError, match="differs from the cache"):
        ops.paged_attention(
            out.half(), batch.query.half(), batch.key_cache, batch.value_cache, block_tables, context_lens, 20, 1.0, 0
        )
    with pytest.raises(RuntimeError, match="block_tables must be Int"):
        ops.paged_attention(
            out, batch.query, batch.key_cache, batch.value_cache, block_tables.long(), context_lens, 20, 1.0, 0
        )
