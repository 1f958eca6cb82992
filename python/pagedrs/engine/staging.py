"""A step's host arrays on the device in one copy.

On CUDA, every array a step needs (token ids, positions, slot mapping, block tables, ...)
is packed into one persistent pinned host buffer and sent with a single non-blocking copy
into one persistent device buffer; the tensors handed out are views of it. Both buffers grow
(doubling) and are otherwise reused step after step, which is also what CUDA graphs need:
fixed addresses. On CPU nothing is copied: the numpy arrays are wrapped as they are.

NOTE: reusing the pinned buffer is safe because every step ends with a device-to-host copy of
the sampled tokens, which waits for the stream; by the time the next step writes the host
buffer, the previous copy out of it has finished.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 64
"""Bytes each array's start is aligned to in the packed buffers."""


class StagedInputs:
    def __init__(self, device: torch.device):
        self.device = device
        self.copies_to_device = 0
        """Host-to-device copies made (one per `upload` on CUDA; for tests and benchmarks)."""
        self._host: torch.Tensor | None = None
        self._host_view: np.ndarray | None = None
        self._device: torch.Tensor | None = None

    def upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """The arrays as tensors on the device (same dtypes and shapes)."""
        arrays = tuple(np.ascontiguousarray(array) for array in arrays)
        if self.device.type != "cuda":
            return [torch.from_numpy(array) for array in arrays]
        offsets, end = [], 0
        for array in arrays:
            offsets.append(end)
            end += -(-array.nbytes // _ALIGN) * _ALIGN
        self._reserve(max(end, _ALIGN))
        for array, offset in zip(arrays, offsets):
            self._host_view[offset : offset + array.nbytes] = array.reshape(-1).view(np.uint8)
        self._device[:end].copy_(self._host[:end], non_blocking=True)
        self.copies_to_device += 1
        tensors = []
        for array, offset in zip(arrays, offsets):
            dtype = torch.from_numpy(array[:0]).dtype
            tensors.append(self._device[offset : offset + array.nbytes].view(dtype).view(array.shape))
        return tensors

    def _reserve(self, num_bytes: int) -> None:
        if self._host is not None and len(self._host) >= num_bytes:
            return
        capacity = max(num_bytes, 2 * (len(self._host) if self._host is not None else 1 << 16))
        self._host = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        self._host_view = self._host.numpy()
        self._device = torch.empty(capacity, dtype=torch.uint8, device=self.device)
