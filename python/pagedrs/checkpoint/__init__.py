"""Reading a checkpoint's tensors, lazily, by Hugging Face name: what the model loaders and the
quantized layers (`pagedrs.quant`) take their weights from. Nothing here imports a model or a
layer.

- `ModelSource`: where a checkpoint's files are (`pagedrs.models.loader.resolve_model` finds it);
- `WeightHandle`: one tensor, read by slices; `SafetensorsHandle` for a safetensors file;
- `iter_weights`: every tensor of a checkpoint (safetensors, ``pytorch_model*.bin``, GGUF);
- `pagedrs.checkpoint.gguf`: a GGUF file read as stored, quantized blocks kept packed;
- `pagedrs.checkpoint.ggml_blocks`: the GGUF block formats the CPU kernels run on.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

ROPE_FACTORS = "rope_freqs.weight"
"""The name GGUF files' ``rope_freqs`` tensor is read under: Llama 3's rotary scaling as one
divisor per frequency, which Hugging Face checkpoints do not hold (they compute it)."""


GGUF_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3moe",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3",
    "granite",
    "olmo2",
)
"""The GGUF architectures whose tensors and metadata pagedrs reads (`pagedrs.checkpoint.gguf`);
llama.cpp stores Mixtral as ``llama`` with experts."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are."""

    directory: str
    gguf_file: str | None
    """File name inside ``directory`` for a GGUF model; ``None`` for a safetensors checkpoint."""

    @property
    def name(self) -> str:
        return os.path.join(self.directory, self.gguf_file) if self.gguf_file else self.directory


class WeightHandle(Protocol):
    """One checkpoint tensor, read lazily: indexing (``h[rows]``, ``h[:, cols]``, ``h[:]``)
    reads just that slice, so a tensor-parallel rank never materializes tensors it holds only
    a shard of. ``torch.Tensor`` satisfies it."""

    @property
    def shape(self) -> Any: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


class RowSlice:
    """Rows ``start .. start + size`` of a checkpoint tensor, read lazily: a part of a fused
    tensor (Phi-3's ``qkv_proj``) as a tensor of its own. Indexing and, for a GGUF tensor,
    ``packed_rows`` / ``packed_cols`` read just those rows; ``ggml_type`` and ``quantized``
    are the tensor's."""

    def __init__(self, handle: WeightHandle, start: int, size: int):
        if start < 0 or start + size > handle.shape[0]:
            raise ValueError(f"rows {start}:{start + size} are outside a tensor of {handle.shape[0]} rows")
        self._handle, self._start, self._size = handle, start, size
        self.shape = (size, *tuple(handle.shape)[1:])

    def _rows(self, key: Any) -> slice:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"a row slice is indexed by contiguous slices, not {key!r}")
        start, stop, _ = key.indices(self._size)
        return slice(self._start + start, self._start + max(start, stop))

    def __getitem__(self, index: Any) -> torch.Tensor:
        if isinstance(index, tuple):
            return self._handle[(self._rows(index[0]),) + tuple(index[1:])]
        return self._handle[self._rows(index)]

    def packed_rows(self, rows: slice = slice(None)) -> torch.Tensor:
        return self._handle.packed_rows(self._rows(rows))  # type: ignore[attr-defined]

    def packed_cols(self, cols: slice) -> torch.Tensor:
        return self._handle.packed_cols(cols)[self._start : self._start + self._size]  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        if name in ("ggml_type", "quantized"):  # a GGUF tensor's, where the handle is one
            return getattr(self._handle, name)
        raise AttributeError(name)


class ExpertSlice:
    """Expert ``index`` of a 3-D tensor that stacks every expert's matrix (``[E, rows, cols]``:
    transformers' fused experts, llama.cpp's ``ffn_*_exps``) as a 2-D tensor of its own, read
    lazily: ``h[rows]`` and ``h[:, cols]`` read just that expert's slice."""

    def __init__(self, handle: WeightHandle, index: int):
        if len(handle.shape) != 3 or not 0 <= index < handle.shape[0]:
            raise ValueError(f"expert {index} of a tensor of shape {tuple(handle.shape)} (not [experts, rows, cols])")
        self._handle, self._index = handle, index
        self.shape = tuple(handle.shape)[1:]

    def __getitem__(self, index: Any) -> torch.Tensor:
        rest = index if isinstance(index, tuple) else (index,)
        return self._handle[(self._index,) + tuple(rest)]


def expert_of(handle: WeightHandle, index: int) -> WeightHandle:
    """Expert ``index`` of a stacked 3-D tensor as a 2-D handle: a GGUF tensor's own (which
    hands out packed rows too), else an `ExpertSlice`."""
    expert = getattr(handle, "expert", None)
    return expert(index) if expert is not None else ExpertSlice(handle, index)


class SafetensorsHandle:
    """A tensor of a memory-mapped safetensors file; a slice reads only its bytes."""

    def __init__(self, file: Any, name: str):
        self._slice = file.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._slice[index]


def iter_weights(source: ModelSource) -> Iterator[tuple[str, WeightHandle]]:
    """Checkpoint tensors by Hugging Face name, as lazy handles of the full (unsharded)
    tensor: the model's loaders index out this rank's shard."""
    if source.gguf_file is not None:
        # Memory-mapped; a slice dequantizes only its blocks, exactly as transformers does
        # (`pagedrs.checkpoint.gguf`; `pagedrs.quant.loading` also keeps them packed).
        from pagedrs.checkpoint.gguf import GGUFCheckpoint

        yield from GGUFCheckpoint(os.path.join(source.directory, source.gguf_file))
        return
    files = sorted(glob.glob(os.path.join(source.directory, "*.safetensors")))
    if files:
        from safetensors import safe_open

        for path in files:
            with safe_open(path, framework="pt") as file:
                for name in file.keys():
                    yield name, SafetensorsHandle(file, name)
        return
    bins = sorted(glob.glob(os.path.join(source.directory, "pytorch_model*.bin")))
    if not bins:
        raise ValueError(f"no *.safetensors or pytorch_model*.bin weights in {source.directory!r}")
    for path in bins:
        # mmap: pages of other ranks' shards are never read. (Files of torch's legacy format,
        # before 1.6, cannot be mapped: those are read whole.)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            state = torch.load(path, map_location="cpu", weights_only=True)
        yield from state.items()
