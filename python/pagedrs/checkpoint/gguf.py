"""A GGUF checkpoint read as stored: memory-mapped by ``gguf.GGUFReader``, each tensor a lazy
handle under its Hugging Face name that reads (and dequantizes) only the slice asked for, or
hands out its packed rows for the quantized linears.

Orientation: a GGUF matrix of ``ne = [in, out]`` is stored as ``out`` rows of ``in`` weights (a
quantized row is ``in / block_weights`` blocks), which is Hugging Face's ``[out, in]``: rows are output
features, and a row range of a packed weight is a row range of its bytes.

NOTE: llama.cpp's converter permutes the rows of q and k of ``llama`` models (its rotary pairs
adjacent features, Hugging Face's pairs halves of a head); transformers undoes it when loading,
and so do we, as a row order: per head of ``2 * half`` rows, Hugging Face's row ``a * half + d``
is GGUF's row ``2 d + a``. Rows move whole, so packed rows are permuted without dequantizing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf import quants as gguf_quants

from pagedrs.checkpoint import GGUF_ARCHITECTURES, ROPE_FACTORS, ggml_blocks

FLOAT_TYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Tensors llama.cpp stores that Hugging Face checkpoints do not: Llama 3's rotary scaling,
# as one divisor per frequency (transformers' GGUF loader drops it, and with it the scaling).
_EXTRA = {"rope_freqs": ROPE_FACTORS.removesuffix(".weight")}

# Metadata transformers turns into the model's config (`transformers.integrations.ggml`); any
# other key of the architecture's own (``llama.rope.scaling.type``, ``llama.attention.
# sliding_window``, ...) would change the computation without reaching the config.
_IGNORED_KEYS = {"rope.scaling.type": ("none",)}

_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL = re.compile(r"(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a Llama-family GGUF tensor (`ROPE_FACTORS` for Llama 3's
    ``rope_freqs``, which Hugging Face checkpoints do not hold). Raises on a name it does not
    know."""
    match = _LAYER.fullmatch(gguf_name)
    if match:
        layer, part, kind = match.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    match = _GLOBAL.fullmatch(gguf_name)
    if match:
        part, kind = match.groups()
        if part in _EXTRA:
            return f"{_EXTRA[part]}.{kind}"
        if part in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[part]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart that pagedrs knows")


def rotary_row_order(num_rows: int, num_heads: int) -> np.ndarray:
    """GGUF row of each Hugging Face row of llama's q or k (see the module's note)."""
    half = num_rows // num_heads // 2
    if half * 2 * num_heads != num_rows:
        raise ValueError(f"{num_rows} rows are not {num_heads} heads of an even size")
    head, a, d = np.meshgrid(np.arange(num_heads), np.arange(2), np.arange(half), indexing="ij")
    return (head * 2 * half + 2 * d + a).reshape(-1)


def _rows_of(key: Any, num_rows: int) -> range:
    if not isinstance(key, slice):
        raise TypeError(f"a GGUF tensor is indexed by slices (h[rows], h[:, cols], h[:]), not {key!r}")
    start, stop, step = key.indices(num_rows)
    if step != 1:
        raise ValueError("a GGUF tensor is read in contiguous slices (step 1)")
    return range(start, max(start, stop))


class GGUFTensor:
    """One tensor of a GGUF file, read lazily: ``h[rows]``, ``h[:, cols]``, ``h[:]`` return
    float32 torch tensors of just that slice (dequantized as ``gguf.quants.dequantize`` does);
    ``packed_rows`` returns stored blocks for the quantized linears."""

    def __init__(self, name: str, tensor: ReaderTensor, row_order: np.ndarray | None):
        self.name = name
        self.ggml_type = GGMLQuantizationType(tensor.tensor_type)
        self._data = tensor.data  # a view of the memory map: [rows, row_bytes] or [rows, cols]
        # GGUF lists dimensions innermost first; Hugging Face outermost first.
        self.shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        self._row_order = row_order

    @property
    def quantized(self) -> bool:
        return self.ggml_type not in FLOAT_TYPES and self.ggml_type != GGMLQuantizationType.BF16

    @property
    def nbytes(self) -> int:
        return int(self._data.nbytes)

    def _stored(self, rows: range, stored_cols: slice = slice(None)) -> np.ndarray:
        """Stored rows (in Hugging Face's order), cut to ``stored_cols`` of each (items of the
        memory map's row: bytes of a packed row, elements of a float one): a copy, never a view
        of the memory map.

        NOTE: the view is cut before the copy, so a column shard (a row-parallel rank's) reads
        just its part of each row, not every page of the tensor."""
        order = slice(rows.start, rows.stop) if self._row_order is None else self._row_order[rows.start : rows.stop]
        view = self._data[order] if stored_cols == slice(None) else self._data[order, stored_cols]
        return np.array(view, order="C")  # a copy even where the view is already contiguous

    def packed_rows(self, rows: slice = slice(None)) -> torch.Tensor:
        """uint8 ``[num_rows, row_bytes]``: the stored blocks of a row range of a quantized matrix."""
        if not self.quantized or len(self.shape) != 2:
            raise ValueError(f"{self.name} is not a quantized matrix ({self.ggml_type.name}, shape {self.shape})")
        return torch.from_numpy(self._stored(_rows_of(rows, self.shape[0])))

    def packed_cols(self, cols: slice) -> torch.Tensor:
        """uint8 ``[rows, num_cols / block_weights * block_bytes]``: the blocks of a column range of every
        row (the range must start and end on block boundaries)."""
        block_size, type_size = gguf_quants.GGML_QUANT_SIZES[self.ggml_type]
        span = _rows_of(cols, self.shape[1])
        if span.start % block_size or span.stop % block_size:
            raise ValueError(f"columns {span.start}:{span.stop} of {self.name} do not fall on {block_size}-blocks")
        if not self.quantized or len(self.shape) != 2:
            raise ValueError(f"{self.name} is not a quantized matrix ({self.ggml_type.name}, shape {self.shape})")
        stored_cols = slice(span.start // block_size * type_size, span.stop // block_size * type_size)
        return torch.from_numpy(self._stored(range(self.shape[0]), stored_cols))

    def _dequantize(self, stored: np.ndarray) -> torch.Tensor:
        if self.ggml_type in ggml_blocks.KERNEL_TYPES:
            return ggml_blocks.dequantize(torch.from_numpy(stored), self.ggml_type)
        if self.ggml_type == GGMLQuantizationType.BF16:
            return torch.from_numpy(stored.view(np.int16)).view(torch.bfloat16).float()
        if self.ggml_type in FLOAT_TYPES:
            return torch.from_numpy(stored.astype(np.float32, copy=False))  # stored is a copy already
        return torch.from_numpy(gguf_quants.dequantize(stored, self.ggml_type))

    def __getitem__(self, key: Any) -> torch.Tensor:
        rows_key, cols_key = key if isinstance(key, tuple) else (key, slice(None))
        rows = _rows_of(rows_key, self.shape[0])
        if len(self.shape) == 1:
            if cols_key != slice(None):
                raise ValueError(f"{self.name} is a vector: it has no columns")
            return self._dequantize(self._stored(rows)).reshape(len(rows))
        cols = _rows_of(cols_key, self.shape[1])
        if not self.quantized:
            # Items of a stored row per column: 1 for F16/F32 (elements), 2 for BF16 (bytes).
            per_col = self._data.shape[1] // self.shape[1]
            stored = self._stored(rows, slice(cols.start * per_col, cols.stop * per_col))
            return self._dequantize(stored).reshape(len(rows), len(cols))
        # Only the blocks that hold the columns are read and dequantized.
        block_size, type_size = gguf_quants.GGML_QUANT_SIZES[self.ggml_type]
        first, last = cols.start // block_size, -(-cols.stop // block_size)
        stored = self._stored(rows, slice(first * type_size, last * type_size))
        values = self._dequantize(stored).reshape(len(rows), -1)
        offset = first * block_size
        return values[:, cols.start - offset : cols.stop - offset].contiguous()

    def __repr__(self) -> str:
        return f"GGUFTensor({self.name!r}, {self.ggml_type.name}, shape={self.shape})"


def _field(reader: GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def check_metadata(reader: GGUFReader, architecture: str) -> None:
    """Refuses a GGUF file whose architecture metadata holds settings that change the model's
    computation but that transformers' config does not carry (so pagedrs would silently run
    without them)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    if architecture not in GGUF_ARCHITECTURES:
        # NOTE: not only a matter of names: llama.cpp stores Gemma's norms as 1 + w, and
        # Phi-3's q/k/v fused; such files must not load as if they were Llama's.
        raise ValueError(
            f"GGUF files of architecture {architecture!r} are not supported yet (pagedrs reads "
            f"{', '.join(GGUF_ARCHITECTURES)}; load its safetensors checkpoint instead)"
        )
    mapping = cast("dict[str, Any] | None", GGUF_CONFIG_MAPPING.get(architecture))
    if mapping is None:
        raise ValueError(f"GGUF architecture {architecture!r} is not one transformers reads a config from")
    prefix = f"{architecture}."
    unknown = []
    for key in reader.fields:
        if not key.startswith(prefix):
            continue
        name = key.removeprefix(prefix)
        if name in mapping:
            continue
        harmless = _IGNORED_KEYS.get(name)
        value = _field(reader, key)
        if harmless is not None and str(value) in harmless:
            continue
        unknown.append(f"{key}={value!r}")
    if unknown:
        raise ValueError(
            f"the GGUF file sets {', '.join(sorted(unknown))}, which pagedrs cannot carry into the model "
            "(transformers' config drops it): refusing to run the model without it"
        )


class GGUFCheckpoint:
    """The tensors of a GGUF file by Hugging Face name (lazy handles over one memory map)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        reader = GGUFReader(self.path, "r")
        self.architecture = str(_field(reader, "general.architecture"))
        check_metadata(reader, self.architecture)
        num_heads = _field(reader, f"{self.architecture}.attention.head_count")
        num_kv_heads = _field(reader, f"{self.architecture}.attention.head_count_kv") or num_heads
        self.tensors: dict[str, GGUFTensor] = {}
        for tensor in reader.tensors:
            name = hf_name(tensor.name)
            row_order = None
            # transformers' LlamaTensorProcessor: only the `llama` architecture is permuted.
            if self.architecture == "llama" and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
                heads = num_heads if ".attn_q." in tensor.name else num_kv_heads
                row_order = rotary_row_order(int(tensor.shape[-1]), int(heads))
            self.tensors[name] = GGUFTensor(name, tensor, row_order)

    def __iter__(self) -> Iterator[tuple[str, GGUFTensor]]:
        return iter(self.tensors.items())

    def ggml_types(self) -> dict[str, GGMLQuantizationType]:
        """Each tensor's stored type, by Hugging Face name (to choose the linears before loading)."""
        return {name: handle.ggml_type for name, handle in self.tensors.items()}
