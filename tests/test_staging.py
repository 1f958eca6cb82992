"""Step inputs reach the device as the arrays they came from (CPU: wrapped, no copy)."""

import numpy as np
import pytest
import torch

from pagedrs.engine.staging import StagedInputs


def _arrays():
    return (np.arange(7, dtype=np.int64), np.arange(12, dtype=np.int32).reshape(3, 4), np.array([2.5], np.float32),
            np.zeros(0, np.int64))


def test_cpu_inputs_are_the_numpy_arrays_themselves():
    arrays = _arrays()
    tensors = StagedInputs(torch.device("cpu")).upload(*arrays)
    for array, tensor in zip(arrays, tensors):
        assert tensor.numpy().base is array or np.shares_memory(tensor.numpy(), array) or array.size == 0
        assert tensor.dtype == torch.from_numpy(array).dtype and tuple(tensor.shape) == array.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_inputs_arrive_in_one_copy_into_reused_buffers():
    staged = StagedInputs(torch.device("cuda"))
    for step in range(3):
        arrays = tuple(a + step for a in _arrays())
        tensors = staged.upload(*arrays)
        for array, tensor in zip(arrays, tensors):
            assert tensor.is_cuda and np.array_equal(tensor.cpu().numpy(), array)
    assert staged.copies_to_device == 3
    big = staged.upload(np.arange(1 << 20, dtype=np.int64))[0]
    assert int(big[-1]) == (1 << 20) - 1
