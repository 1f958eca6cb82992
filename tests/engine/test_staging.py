"""Step inputs reach the device as the arrays they came from: on CPU wrapped without a copy;
staged, packed into one buffer and copied once per block (the CUDA path, run here on CPU
buffers so every machine checks the packing)."""

import numpy as np
import pytest
import torch

from pagedrs.engine.staging import StagedInputs
from tests.helpers.batches import mixed_step


def _arrays(step: int = 0):
    return (
        np.arange(7, dtype=np.int64) + step,
        np.arange(12, dtype=np.int32).reshape(3, 4) - step,
        np.array([2.5 + step], np.float32),
        np.zeros(0, np.int64),
    )


def _assert_same(arrays, tensors):
    for array, tensor in zip(arrays, tensors, strict=True):
        assert tensor.dtype == torch.from_numpy(array).dtype and tuple(tensor.shape) == array.shape
        assert np.array_equal(tensor.cpu().numpy(), array)


def test_cpu_inputs_are_the_numpy_arrays_themselves():
    arrays = _arrays()
    tensors = StagedInputs(torch.device("cpu")).upload(*arrays)
    _assert_same(arrays, tensors)
    assert all(np.shares_memory(t.numpy(), a) for t, a in zip(tensors, arrays) if a.size)


def test_a_block_of_uploads_is_one_copy_even_when_the_buffer_grows():
    staged = StagedInputs(torch.device("cpu"), stage=True)
    copies = []
    for step in range(4):
        before = staged.copies_to_device
        with staged.one_copy():
            first = staged.upload(*_arrays(step))
            big = np.arange(50_000, dtype=np.int64) * (step + 1)  # 400 KB: outgrows the 64 KiB start
            second = staged.upload(big, np.array([[step]], np.int32))
        _assert_same(_arrays(step), first)  # views on the outgrown buffer stay right
        _assert_same((big, np.array([[step]], np.int32)), second)
        copies.append(staged.copies_to_device - before)
    # A block that outgrows the buffers copies what it packed before growing, then the rest;
    # once grown (doubling), one copy a block.
    assert copies[0] == 2 and copies[-2:] == [1, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_inputs_arrive_in_one_copy_into_reused_buffers():
    staged = StagedInputs(torch.device("cuda"))
    for step in range(3):
        with staged.one_copy():
            tensors = staged.upload(*_arrays(step))
        assert all(t.is_cuda for t in tensors)
        _assert_same(_arrays(step), tensors)
    assert staged.copies_to_device == 3
    big = staged.upload(np.arange(1 << 20, dtype=np.int64))[0]
    assert int(big[-1]) == (1 << 20) - 1


def test_cuda_metadata_staged_in_one_copy_equals_the_direct_build():
    from pagedrs.attention.cuda_backend import CudaAttentionMetadata

    kwargs = mixed_step()
    direct = CudaAttentionMetadata.build(**kwargs)
    staged = StagedInputs(torch.device("cpu"), stage=True)
    with staged.one_copy():
        packed = CudaAttentionMetadata.build(**kwargs, upload=staged.upload)
    assert staged.copies_to_device == 1
    assert torch.equal(direct.slot_mapping, packed.slot_mapping)
    for a, b in ((direct.decodes, packed.decodes), (direct.prefills, packed.prefills)):
        assert (a.rows is None) == (b.rows is None) and (a.rows is None or torch.equal(a.rows, b.rows))
        for name in ("block_tables", "cu_seqlens_q", "context_lens"):
            assert torch.equal(getattr(a, name), getattr(b, name)) and getattr(a, name).dtype == getattr(b, name).dtype
        assert (a.max_context_len, a.num_rows) == (b.max_context_len, b.num_rows)


def test_the_engine_gives_the_same_tokens_with_its_inputs_staged(tiny_llama):
    from pagedrs import LLM, SamplingParams

    prompts = [[5, 17, 33, 2, 9], list(range(10, 47))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2)  # n = 2: block copies too
    plain = LLM(tiny_llama, block_size=4)
    staged = LLM(tiny_llama, block_size=4)
    staged.engine.runner.inputs = StagedInputs(torch.device("cpu"), stage=True)
    expected = [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [[c.token_ids for c in o.outputs] for o in staged.generate(prompts, params, use_tqdm=False)] == expected
    assert staged.engine.runner.inputs.copies_to_device > 0
