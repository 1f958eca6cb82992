"""The "cpu" attention backend against the torch reference: decodes and prefill chunks over
cached prefixes, mixed and ragged in one batch, grouped-query attention, sliding windows,
float32 / bfloat16 / float16 caches, several head and block sizes. Each case runs both ways a
prefill chunk can go (the compiled kernel in ``cpu/``, or scaled_dot_product_attention over
its gathered blocks); then the engine on the backend, token for token against the reference."""

from __future__ import annotations

import pytest
import torch

from pagedrs.attention import cpu_backend, select_backend
from pagedrs.attention.cpu_backend import CpuAttentionMetadata
from pagedrs.attention.torch_ref import AttentionMetadata, write_kv
from pagedrs.kernels.cpu import available
from tests.helpers.batches import make_step

pytestmark = pytest.mark.skipif(not available(), reason="the CPU attention kernel does not build here")

# (context, rows this step) per sequence: decodes (one row) with ragged contexts, a whole
# prompt, prefill chunks over a cached prefix, a one-token context.
MIXED = [(1, 1), (37, 1), (40, 40), (70, 13), (9, 9), (130, 1), (2, 1), (65, 64), (17, 2)]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(params=["kernel", "sdpa"])
def prefill_route(request, monkeypatch):
    """Every chunk of two or more rows through the kernel, or through SDPA."""
    monkeypatch.setattr(cpu_backend, "SDPA_MIN_ROWS", 1 << 30 if request.param == "kernel" else 2)
    return request.param


def attend_both(seqs, *, sliding_window=None, softcap=None, sinks=None, **shape):
    """The step through the reference and through the kernel, each on its own copy of the
    caches: (reference out, kernel out, reference caches, kernel caches)."""
    arrays, (query, key, value), caches = make_step(seqs, **shape)
    scale = shape["head_dim"] ** -0.5
    results = []
    for metadata in (AttentionMetadata, CpuAttentionMetadata):
        key_cache, value_cache = (c.clone() for c in caches)
        meta = metadata.build(**arrays, sliding_window=sliding_window, device=torch.device("cpu"))
        out = meta.attend(query, key, value, key_cache, value_cache, scale, softcap=softcap, sinks=sinks)
        results.append((out, key_cache, value_cache))
    (expected, *expected_caches), (actual, *actual_caches) = results
    return expected, actual, expected_caches, actual_caches


def assert_close(actual, expected, dtype):
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 48, 40])  # 40: not a multiple of the kernel's 16 lanes
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 2)], ids=["group1", "group3", "group4"])
def test_mixed_batch_matches_the_reference(num_heads, num_kv_heads, block_size, head_dim, dtype, prefill_route):
    expected, actual, expected_caches, actual_caches = attend_both(
        MIXED,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
    )
    assert actual.shape == expected.shape
    assert_close(actual, expected, dtype)
    for actual_cache, expected_cache in zip(actual_caches, expected_caches):
        assert torch.equal(actual_cache, expected_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("sliding_window", [None, 1, 5, 32, 64])
def test_sliding_window_and_half_precision_match_the_reference(dtype, sliding_window, prefill_route):
    expected, actual, _, _ = attend_both(
        MIXED,
        sliding_window=sliding_window,
        block_size=16,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        dtype=dtype,
    )
    assert actual.dtype == dtype
    assert_close(actual, expected, dtype)


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_softcap_matches_the_reference(sliding_window, prefill_route):
    """Gemma 2's softcap: the kernel caps each score by tanh; SDPA has none, so a capped chunk
    takes the reference's path."""
    shape = dict(block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    expected, actual, _, _ = attend_both(MIXED, sliding_window=sliding_window, softcap=0.05, **shape)
    assert_close(actual, expected, torch.float32)
    uncapped, _, _, _ = attend_both(MIXED, sliding_window=sliding_window, **shape)
    assert not torch.allclose(uncapped, expected, atol=1e-3)  # the cap bends these scores


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_prefill_chunk_over_a_cached_prefix(dtype, prefill_route):
    # A 200-row chunk after 300 cached tokens, beside decodes: many row tiles and key tiles.
    seqs = [(500, 200), (300, 1), (511, 1)]
    expected, actual, _, _ = attend_both(seqs, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype)
    assert_close(actual, expected, dtype)


def test_decodes_only_and_prefills_only(prefill_route):
    shape = dict(block_size=8, num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    for seqs in ([(c, 1) for c in (1, 5, 8, 9, 63, 64, 65)], [(12, 12), (30, 7)]):
        expected, actual, _, _ = attend_both(seqs, **shape)
        assert_close(actual, expected, torch.float32)


def test_query_with_a_row_stride_is_read_in_place(prefill_route):
    # q as the model slices it out of a fused qkv projection: heads contiguous, rows strided.
    arrays, (query, key, value), (key_cache, value_cache) = make_step(
        MIXED, block_size=16, num_heads=6, num_kv_heads=2, head_dim=32, dtype=torch.float32
    )
    fused = torch.cat([query.flatten(1), torch.zeros(query.shape[0], 64)], dim=1)
    strided = fused[:, : 6 * 32].view(-1, 6, 32)
    assert not strided.is_contiguous()
    meta = CpuAttentionMetadata.build(**arrays, sliding_window=None, device=torch.device("cpu"))
    out = meta.attend(strided, key, value, key_cache, value_cache, 0.2)
    assert torch.equal(out, meta.attend(query, key, value, key_cache, value_cache, 0.2))


def test_inconsistent_layouts_are_refused():
    from pagedrs.kernels.cpu import load

    ops = load()
    key_cache = torch.zeros(4, 8, 2, 16)
    query = torch.zeros(2, 4, 16)
    out = torch.empty_like(query)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        ops.paged_attention(
            out, query, key_cache, key_cache, tables, cu, torch.tensor([5, 17], dtype=torch.int32), 1.0, 0, 0.0
        )
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.paged_attention(
            out,
            query,
            key_cache,
            key_cache,
            torch.tensor([[0, 9], [2, 3]], dtype=torch.int32),
            cu,
            torch.tensor([12, 3], dtype=torch.int32),
            1.0,
            0,
            0.0,
        )
    with pytest.raises(RuntimeError, match="do not group"):
        ops.paged_attention(
            torch.empty(2, 3, 16),
            torch.zeros(2, 3, 16),
            key_cache,
            key_cache,
            tables,
            cu,
            torch.tensor([1, 1], dtype=torch.int32),
            1.0,
            0,
            0.0,
        )
    with pytest.raises(RuntimeError, match="dtype"):
        ops.paged_attention(
            out, query.double(), key_cache, key_cache, tables, cu, torch.tensor([1, 1], dtype=torch.int32), 1.0, 0, 0.0
        )


@pytest.mark.slow  # the engine twice, in chunks of 16 tokens: over 10 s
def test_auto_picks_the_kernel_and_the_engine_generates_what_the_reference_does(tiny_llama):
    from pagedrs import LLM, SamplingParams

    assert select_backend("auto", torch.device("cpu")).name == "cpu"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 17, 33, 2, 9], list(range(10, 60)), [7, 7, 7, 300, 12]]
    outputs = {}
    for backend in ("cpu", "torch"):
        llm = LLM(tiny_llama, attention_backend=backend, max_num_batched_tokens=16, max_num_seqs=4, block_size=8)
        assert llm.engine.runner.attention_backend.name == backend
        outputs[backend] = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["cpu"] == outputs["torch"]


SHAPE = dict(block_size=16, num_heads=9, num_kv_heads=3, head_dim=64)


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_attention_sinks_match_the_reference(sliding_window, prefill_route):
    """gpt-oss's sinks (a logit per head in the softmax, with no value), large and small, in the
    kernel and in the chunks that would go to SDPA, against the reference."""
    sinks = torch.tensor([-3.0, 0.0, 1.5, 6.0, -0.5, 2.0, 0.3, -8.0, 4.0])
    expected, actual, _, _ = attend_both(
        MIXED, sliding_window=sliding_window, sinks=sinks, dtype=torch.float32, **SHAPE
    )
    assert_close(actual, expected, torch.float32)
    without, _, _, _ = attend_both(MIXED, sliding_window=sliding_window, dtype=torch.float32, **SHAPE)
    assert (expected - without).abs().max() > 1e-2  # the sinks change the result


# Contexts past the kernel's split (its keys in parts of 512, merged): decodes just under, at
# and past a part's end, far past it, and short chunks reaching across a part boundary.
LONG = [(511, 1), (512, 1), (513, 1), (1300, 1), (1100, 3), (520, 8), (518, 9), (40, 1)]


@pytest.mark.parametrize("seqs", [MIXED, LONG], ids=["mixed", "long"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_float32_queries_over_a_smaller_cache_match_the_reference(cache_dtype, sliding_window, seqs, prefill_route):
    """``kv_cache_dtype`` bfloat16 / float16 / fp8 under a float32 model: the step's keys and
    values are rounded as they are stored, and every read (kernel and SDPA chunks) takes them as
    float32, as the torch reference does over the same caches."""
    arrays, (query, key, value), caches = make_step(
        seqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32
    )
    results = []
    for metadata in (AttentionMetadata, CpuAttentionMetadata):
        key_cache, value_cache = (c.to(cache_dtype) for c in caches)
        meta = metadata.build(**arrays, sliding_window=sliding_window, device=torch.device("cpu"))
        out = meta.attend(query, key, value, key_cache, value_cache, 64**-0.5)
        assert out.dtype == torch.float32
        results.append((out, key_cache, value_cache))
    (expected, *expected_caches), (actual, *actual_caches) = results
    for ours, theirs in zip(actual_caches, expected_caches):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))  # the same rounding of the new rows
    assert_close(actual, expected, torch.float32)


def test_an_fp8_cache_clamps_what_e4m3_cannot_hold():
    """Keys and values past e4m3's largest finite value (448) are stored as ±448, never NaN."""
    key_cache = torch.zeros(2, 4, 1, 8, dtype=torch.float8_e4m3fn)
    value_cache = torch.zeros_like(key_cache)
    rows = torch.tensor([1000.0, -1e6, 448.0, 1.0, 0.1, -3.3, 1e-4, 0.0]).view(1, 1, 8)
    write_kv(rows, -rows, key_cache, value_cache, torch.tensor([5]))
    stored = key_cache.view(-1, 8)[5].float()
    assert stored.tolist()[:4] == [448.0, -448.0, 448.0, 1.0]
    assert torch.equal(value_cache.view(-1, 8)[5].float(), -stored)
    assert torch.isfinite(key_cache.float()).all()


def test_the_kernel_reads_every_fp8_byte_as_torch_does():
    """A query over a one-key context returns that key's value row: four such rows hold all 254
    finite e4m3 byte values, and the kernel's conversion must give torch's float32 for each."""
    from pagedrs.kernels.cpu import load

    finite = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)] + [0, 0], dtype=torch.uint8)
    value_cache = finite.view(4, 1, 1, 64).view(torch.float8_e4m3fn)
    key_cache = torch.zeros_like(value_cache)
    query = torch.randn(4, 1, 64)
    out = torch.empty_like(query)
    ones = torch.ones(4, dtype=torch.int32)
    blocks = torch.arange(4, dtype=torch.int32).view(4, 1)
    cu_seqlens_q = torch.arange(5, dtype=torch.int32)
    load().paged_attention(out, query, key_cache, value_cache, blocks, cu_seqlens_q, ones, 0.125, 0, 0.0, None)
    assert torch.equal(out.view(4, 64), value_cache.float().view(4, 64))
    # The SDPA chunks' conversion of gathered blocks: every byte, NaNs (0x7F, 0xFF) as NaN, as torch.
    every_byte = torch.arange(256, dtype=torch.uint8).repeat(3)[1:].view(torch.float8_e4m3fn)  # odd length: tails
    torch.testing.assert_close(load().fp8_as_float(every_byte), every_byte.float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sliding_window", [None, 300, 5])
def test_long_contexts_split_over_their_keys_match_the_reference(dtype, sliding_window):
    sinks = torch.tensor([-3.0, 0.0, 1.5, 6.0, -0.5, 2.0, 0.3, -8.0, 4.0])
    for extra in ({}, {"softcap": 20.0}, {"sinks": sinks}):
        expected, actual, _, _ = attend_both(LONG, sliding_window=sliding_window, dtype=dtype, **extra, **SHAPE)
        assert_close(actual, expected, dtype)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_row_gets_the_same_bits_alone_or_in_a_chunk_whatever_the_split(threads):
    """Where a long context's keys are split (at fixed positions) does not depend on the rows
    around a row or on the threads: a row decoded alone equals the same row inside a chunk of
    rows (a speculative-decoding verify, a prompt's last chunk), bit for bit, whether the chunk
    reaches into a part the row does not see or both are split alike."""
    from pagedrs.kernels.cpu import load

    ops = load()
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    num_blocks = 110  # 1,760 slots: the longest context below
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    tables = torch.randperm(num_blocks, dtype=torch.int32)[None, :]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for chunk_end, rows, row in ((518, 8, 0), (518, 8, 6), (700, 5, 4), (1600, 7, 2)):
            query = torch.randn(rows, num_heads, head_dim)
            together = torch.empty_like(query)
            ops.paged_attention(
                together,
                query,
                key_cache,
                value_cache,
                tables,
                torch.tensor([0, rows], dtype=torch.int32),
                torch.tensor([chunk_end], dtype=torch.int32),
                0.125,
                0,
                0.0,
            )
            alone = torch.empty(1, num_heads, head_dim)
            context = chunk_end - rows + row + 1  # the row's position + 1
            ops.paged_attention(
                alone,
                query[row : row + 1].contiguous(),
                key_cache,
                value_cache,
                tables,
                torch.tensor([0, 1], dtype=torch.int32),
                torch.tensor([context], dtype=torch.int32),
                0.125,
                0,
                0.0,
            )
            assert torch.equal(alone[0], together[row]), (chunk_end, rows, row)
    finally:
        torch.set_num_threads(previous)
