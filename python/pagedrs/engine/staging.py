"""A step's host arrays on the device in one copy.

On CUDA, every array a step needs (token ids, positions, logits rows, the attention
metadata's block tables, lengths and slot mapping, block copies) is packed into one persistent
pinned host buffer and sent with a single non-blocking copy into one persistent device buffer;
the tensors handed out are views of it. Inside `one_copy()`, each `upload` packs and returns
its views at once, and the copy is made when the block ends, before anything reads them (the
runner launches no kernel inside the block). Both buffers grow (doubling) and are otherwise
reused step after step, which is also what CUDA graphs need: fixed addresses. On CPU nothing is
copied: the numpy arrays are wrapped as they are.

NOTE: reusing the pinned buffer is safe because every step ends with a device-to-host copy of
the sampled tokens, which waits for the stream; by the time the next step writes the host
buffer, the previous copy out of it has finished. A buffer outgrown in the middle of a block is
kept alive until the next block for the same reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch

_ALIGN = 64
"""Bytes each array's start is aligned to in the packed buffers."""


class _Buffers(NamedTuple):
    host: torch.Tensor
    """``uint8``, pinned on CUDA."""
    host_view: np.ndarray
    """`host` as a numpy array (the same memory)."""
    device: torch.Tensor
    """``uint8``, as long as `host`."""


class StagedInputs:
    """``stage``: pack and copy (the default on CUDA), or wrap the arrays as they are (the
    default elsewhere). Staging on a CPU device copies into a plain buffer: only for tests."""

    def __init__(self, device: torch.device, stage: bool | None = None):
        self.device = device
        self.stage = device.type == "cuda" if stage is None else stage
        self.copies_to_device = 0
        """Host-to-device copies made (for tests and benchmarks)."""
        self._buffers: _Buffers | None = None
        self._start = self._end = 0
        """The bytes packed since the last copy: ``[_start, _end)``."""
        self._batching = False
        self._retired: list[torch.Tensor] = []

    @contextmanager
    def one_copy(self) -> Iterator[None]:
        """Every `upload` inside shares one host-to-device copy, made on leaving the block."""
        self._batching, self._start, self._end = True, 0, 0
        self._retired.clear()
        try:
            yield
        finally:
            self._batching = False
            self._flush()

    def upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """The arrays as tensors on the device (same dtypes and shapes). Outside `one_copy`
        it is a block of its own. Either way: one block a step (see the NOTE above)."""
        arrays = tuple(np.ascontiguousarray(array) for array in arrays)
        if not self.stage:
            return [torch.from_numpy(array).to(self.device) for array in arrays]
        if not self._batching:
            with self.one_copy():
                return self.upload(*arrays)
        sizes = [-(-array.nbytes // _ALIGN) * _ALIGN for array in arrays]
        buffers = self._reserve(self._end + sum(sizes))
        tensors = []
        for array, size in zip(arrays, sizes):
            offset = self._end
            buffers.host_view[offset : offset + array.nbytes] = array.reshape(-1).view(np.uint8)
            dtype = torch.from_numpy(array[:0]).dtype
            tensors.append(buffers.device[offset : offset + array.nbytes].view(dtype).view(array.shape))
            self._end += size
        return tensors

    def _flush(self) -> None:
        if self._buffers is not None and self._end > self._start:
            host, device = self._buffers.host, self._buffers.device
            device[self._start : self._end].copy_(host[self._start : self._end], non_blocking=True)
            self.copies_to_device += 1
        self._start = self._end

    def _reserve(self, num_bytes: int) -> _Buffers:
        """Buffers that hold ``num_bytes``: the current ones, or new ones (then packing restarts at 0)."""
        if self._buffers is not None and len(self._buffers.host) >= num_bytes:
            return self._buffers
        # Views already handed out stay on the old buffers: copy their bytes there first.
        self._flush()
        if self._buffers is not None:
            self._retired += [self._buffers.host, self._buffers.device]
        capacity = max(num_bytes - self._end, 2 * (len(self._buffers.host) if self._buffers is not None else 1 << 16))
        pin = self.device.type == "cuda"
        host = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)
        device = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        self._buffers = _Buffers(host, host.numpy(), device)
        self._start = self._end = 0
        return self._buffers
