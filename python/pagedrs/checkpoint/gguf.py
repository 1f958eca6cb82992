"""A GGUF checkpoint read as stored: memory-mapped by ``gguf.GGUFReader``, each tensor a lazy
handle under its Hugging Face name that reads (and dequantizes) only the slice asked for, or
hands out its packed rows for the quantized linears.

Orientation: a GGUF matrix of ``ne = [in, out]`` is stored as ``out`` rows of ``in`` weights (a
quantized row is ``in / block_weights`` blocks), which is Hugging Face's ``[out, in]``: rows are output
features, and a row range of a packed weight is a row range of its bytes.

NOTE: llama.cpp's converter permutes the rows of q and k of ``llama`` (and ``granite``) models
(its rotary pairs adjacent features, Hugging Face's pairs halves of a head); transformers undoes
it when loading, and so do we, as a row order: per head of ``2 * half`` rows, Hugging Face's row ``a * half + d``
is GGUF's row ``2 d + a``. Rows move whole, so packed rows are permuted without dequantizing.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
from collections.abc import Iterator
from typing import Any, cast

import gguf
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
    # Mixtures of experts: the router, every expert stacked in one 3-D tensor per projection
    # ([experts, rows, cols]; `pagedrs.models.decoder` loads them), and Qwen2-MoE's shared expert.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}

# Per GGUF architecture, the layer tensors whose names differ from the Llama family's.
_ARCH_LAYER_NAMES: dict[str, dict[str, str]] = {
    # Phi-3 keeps q/k/v and gate/up fused, as its Hugging Face checkpoint does.
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
# OLMo 2's norms come after attention and the MLP (there are none before them).
_ARCH_LAYER_NAMES["olmo2"] = {
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# Architectures whose converter stores each RMSNorm weight as 1 + w (Gemma's form of the norm;
# Gemma 3's q/k norms too).
_NORMS_PLUS_ONE = {"gemma", "gemma2", "gemma3"}

# Architectures whose converter permutes q and k as llama's does (see the module's note).
_PERMUTED_QK = {"llama", "granite"}

_COMMON_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
}
# Architectures transformers reads no config from: pagedrs builds it from the file's metadata
# (`own_config`), as the transformers config class named, with these keys (after the
# architecture's prefix) -> its attributes.
OWN_CONFIGS: dict[str, tuple[str, dict[str, str]]] = {
    "gemma": ("GemmaConfig", {**_COMMON_KEYS, "attention.key_length": "head_dim"}),
    "granite": (
        "GraniteConfig",
        {
            **_COMMON_KEYS,
            "attention.scale": "attention_multiplier",
            "embedding_scale": "embedding_multiplier",
            "residual_scale": "residual_multiplier",
            "logit_scale": "logits_scaling",
        },
    ),
    "olmo2": ("Olmo2Config", _COMMON_KEYS),
}

# Per GGUF architecture, metadata transformers' config drops that pagedrs carries into it
# (`complete_config`): key after the architecture's prefix -> config attribute.
_CARRIED: dict[str, dict[str, str]] = {
    # Mixtral is a `llama` file with experts (`complete_config` makes its config Mixtral's).
    "llama": {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "phi3": {"attention.sliding_window": "sliding_window"},
    "gemma2": {
        "attn_logit_softcapping": "attn_logit_softcapping",
        "final_logit_softcapping": "final_logit_softcapping",
    },
}

# Keys `complete_config` checks against the config: the rotary dimension (Phi-3's partial
# rotary factor), the key and value head sizes (which must be the head size), and the rotary
# scaling of Gemma 3's global layers (the only scaling llama.cpp writes for it).
_CHECKED = {"rope.dimension_count", "attention.key_length", "attention.value_length"}
_CHECKED_BY_ARCH = {
    "gemma3": {"rope.scaling.type", "rope.scaling.factor"},
    # Phi-3's LongRoPE, with its `_LONGROPE_TENSORS` (`_phi3_longrope`).
    "phi3": {"rope.scaling.original_context_length", "rope.scaling.attn_factor"},
}

# Phi-3's LongRoPE factors, which llama.cpp stores as tensors: config, not weights.
_LONGROPE_TENSORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}

# Tensors llama.cpp stores that Hugging Face checkpoints do not: Llama 3's rotary scaling,
# as one divisor per frequency (transformers' GGUF loader drops it, and with it the scaling).
_EXTRA = {"rope_freqs": ROPE_FACTORS.removesuffix(".weight")}

# Metadata transformers turns into the model's config (`transformers.integrations.ggml`); any
# other key of the architecture's own (``llama.rope.scaling.type``, ``llama.attention.
# sliding_window``, ...) would change the computation without reaching the config.
_IGNORED_KEYS = {"rope.scaling.type": ("none",)}

# GGUF architectures transformers' GGUF tables spell otherwise.
_TRANSFORMERS_NAMES = {"qwen3moe": "qwen3_moe"}

_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL = re.compile(r"(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, architecture: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor of ``architecture`` (`ROPE_FACTORS` for Llama 3's
    ``rope_freqs``, which Hugging Face checkpoints do not hold). Raises on a name it does not
    know."""
    match = _LAYER.fullmatch(gguf_name)
    if match:
        layer, part, kind = match.groups()
        names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(architecture, {})}
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{kind}"
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

    def __init__(self, name: str, tensor: ReaderTensor, row_order: np.ndarray | None, offset: float = 0.0):
        """``offset``: added to every value read (-1 undoes Gemma's 1 + w of the converter)."""
        self.name = name
        self._offset = offset
        self.ggml_type = GGMLQuantizationType(tensor.tensor_type)
        self._data = tensor.data  # a view of the memory map: [rows, row_bytes] or [rows, cols]
        # GGUF lists dimensions innermost first; Hugging Face outermost first.
        self.shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        self._row_order = row_order

    def expert(self, index: int) -> GGUFTensor:
        """Expert ``index`` of a 3-D ``ffn_*_exps`` tensor (``[experts, rows, cols]``) as a 2-D
        tensor of its own (a view of the same memory map)."""
        if len(self.shape) != 3 or not 0 <= index < self.shape[0] or self._row_order is not None:
            raise ValueError(f"{self.name} (shape {self.shape}) has no expert {index}")
        expert = copy.copy(self)
        expert.name, expert.shape, expert._data = f"{self.name}[{index}]", self.shape[1:], self._data[index]
        return expert

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
            values = self._dequantize(self._stored(rows)).reshape(len(rows))
            return values + self._offset if self._offset else values
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


def check_architecture(architecture: str) -> None:
    """Refuses a GGUF architecture whose tensors and metadata pagedrs does not read."""
    if architecture not in GGUF_ARCHITECTURES:
        # NOTE: not only a matter of names: llama.cpp stores Gemma's norms as 1 + w, Phi-3's
        # q/k/v fused, Granite's multipliers under keys of its own; such files must not load
        # as if they were Llama's.
        raise ValueError(
            f"GGUF files of architecture {architecture!r} are not supported yet (pagedrs reads "
            f"{', '.join(GGUF_ARCHITECTURES)}; load its safetensors checkpoint instead)"
        )


def check_metadata(reader: GGUFReader, architecture: str) -> None:
    """Refuses a GGUF file whose architecture metadata holds settings that change the model's
    computation but that transformers' config does not carry (so pagedrs would silently run
    without them)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    check_architecture(architecture)
    mapping = cast(
        "dict[str, Any] | None", GGUF_CONFIG_MAPPING.get(_TRANSFORMERS_NAMES.get(architecture, architecture))
    )
    if architecture in OWN_CONFIGS:
        mapping = OWN_CONFIGS[architecture][1]
    if mapping is None:
        raise ValueError(f"GGUF architecture {architecture!r} is not one transformers reads a config from")
    prefix = f"{architecture}."
    carried = _CARRIED.get(architecture, {})
    unknown = []
    for key in reader.fields:
        if not key.startswith(prefix):
            continue
        name = key.removeprefix(prefix)
        # A key transformers maps to None is read and dropped: as good as unknown, unless
        # `complete_config` carries it (the rotary dimension, as a partial rotary factor).
        if mapping.get(name) is not None or name in carried or name in _CHECKED:
            continue
        if name in _CHECKED_BY_ARCH.get(architecture, ()):
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


@functools.lru_cache(maxsize=4)
def _parsed(path: str, size: int, mtime_ns: int, inode: int) -> GGUFReader:
    del size, mtime_ns, inode  # the cache key: the file as it is now
    return GGUFReader(path, "r")


def open_reader(path: str | os.PathLike) -> GGUFReader:
    """The file's reader (read-only), parsed once per process while the file is unchanged.

    gguf-py parses a 49k-token vocabulary in seconds (over 5 s for the default model on a 2-core
    machine), and loading a model reads the metadata several times (architecture, config,
    tokenizer, tensors): without the cache the default model took ~50 s to load."""
    name = os.path.abspath(os.fspath(path))
    stat = os.stat(name)
    return _parsed(name, stat.st_size, stat.st_mtime_ns, stat.st_ino)


@contextlib.contextmanager
def shared_readers() -> Iterator[None]:
    """transformers' GGUF loading (its config and tokenizer) parses the file through
    ``gguf.GGUFReader``: within this block, through `open_reader`'s cache instead."""
    original = gguf.GGUFReader

    def reader(path: str | os.PathLike, mode: str = "r") -> GGUFReader:
        return open_reader(path) if mode == "r" else original(path, mode)  # type: ignore[arg-type]

    gguf.GGUFReader = reader  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]


def architecture_of_file(path: str | os.PathLike) -> str:
    """The file's ``general.architecture``."""
    return str(_field(open_reader(path), "general.architecture"))


def own_config(path: str | os.PathLike) -> Any:
    """The transformers config of a GGUF file of an `OWN_CONFIGS` architecture (transformers
    reads none from it), built from the file's metadata; `complete_config` then carries the
    rest, as for every GGUF file."""
    import transformers

    reader = open_reader(path)
    architecture = str(_field(reader, "general.architecture"))
    class_name, keys = OWN_CONFIGS[architecture]
    prefix = f"{architecture}."
    values: dict[str, Any] = {}
    for key, attribute in keys.items():
        value = _field(reader, prefix + key)
        if value is not None:
            values[attribute] = value
    missing = [key for key in ("embedding_length", "block_count", "attention.head_count") if keys[key] not in values]
    if missing:
        raise ValueError(f"the GGUF file has no {', '.join(prefix + key for key in missing)}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("the GGUF file has no tokenizer.ggml.tokens (its vocabulary)")
    values["vocab_size"] = len(tokens)
    values.setdefault("head_dim", int(values["hidden_size"]) // int(values["num_attention_heads"]))
    values["rope_parameters"] = {"rope_type": "default", "rope_theta": float(values.pop("rope_theta", 10000.0))}
    values["tie_word_embeddings"] = all(tensor.name != "output.weight" for tensor in reader.tensors)
    for name in ("bos_token_id", "eos_token_id", "padding_token_id"):
        token = _field(reader, f"tokenizer.ggml.{name}")
        values[name.replace("padding", "pad")] = None if token is None else int(token)
    return getattr(transformers, class_name)(**values)


def complete_config(config: Any, path: str | os.PathLike) -> Any:
    """Carries into ``config`` (transformers' config of a GGUF file) what transformers drops and
    the model's computation needs: the keys of `_CARRIED`, Phi-3's rotary dimension (its partial
    rotary factor), Gemma 2's attention scale as llama.cpp computes it. Refuses a rotary
    dimension the config cannot express. Returns the config: ``config`` itself, or for a
    ``llama`` file with experts (how llama.cpp stores Mixtral) a Mixtral config of its values."""
    reader = open_reader(path)
    architecture = str(_field(reader, "general.architecture"))
    check_architecture(architecture)
    prefix = f"{architecture}."
    for name, attribute in _CARRIED.get(architecture, {}).items():
        value = _field(reader, prefix + name)
        if value is not None:
            setattr(config, attribute, value)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for name in ("attention.key_length", "attention.value_length"):
        size = _field(reader, prefix + name)
        if size is not None and int(size) != head_dim:
            raise ValueError(f"the GGUF file's {prefix + name} is {size}, not the head size {head_dim}")
    rotary_dim = _field(reader, prefix + "rope.dimension_count")
    if rotary_dim is not None and int(rotary_dim) != head_dim:
        if architecture != "phi3":
            raise ValueError(
                f"the GGUF file rotates {rotary_dim} of {head_dim} features per head, "
                f"which pagedrs does not run for {architecture!r}"
            )
        params = dict(getattr(config, "rope_parameters", None) or {})
        params["partial_rotary_factor"] = int(rotary_dim) / head_dim
        config.rope_parameters = params
    if architecture in ("gemma2", "gemma3"):
        # llama.cpp's rule (the file does not say): the 27B models (Gemma 2's 46 layers, Gemma
        # 3's 62) scale by hidden / heads, the others by the head size.
        heads = config.num_attention_heads
        largest = config.num_hidden_layers == (46 if architecture == "gemma2" else 62)
        config.query_pre_attn_scalar = config.hidden_size // heads if largest else head_dim
    if architecture == "gemma3":
        _gemma3_global_rope(config, reader, prefix)
    if architecture == "phi3":
        _phi3_longrope(config, reader, prefix)
    if architecture == "llama" and getattr(config, "num_local_experts", None):
        return _as_mixtral(config)
    return config


def _as_mixtral(config: Any) -> Any:
    """A Mixtral config of a Llama config's values and its experts (llama.cpp writes Mixtral as
    ``llama`` with ``expert_count`` and ``expert_used_count``; transformers reads a Llama)."""
    import transformers

    values = config.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "mlp_bias", "pretraining_tp"):
        values.pop(key, None)
    if values.get("attention_bias"):
        raise ValueError("a Mixtral GGUF file with attention biases is not one pagedrs reads")
    values.pop("attention_bias", None)
    return transformers.MixtralConfig(**values, sliding_window=None)


def _phi3_longrope(config: Any, reader: GGUFReader, prefix: str) -> None:
    """Phi-3's LongRoPE (Phi-3/3.5-mini 128k, Phi-4-mini) as transformers' config spells it,
    from what llama.cpp's converter writes: the short and long factors as the
    ``rope_factors_short`` / ``rope_factors_long`` tensors, the original context as
    ``rope.scaling.original_context_length`` and the cos/sin scale as
    ``rope.scaling.attn_factor``. As in transformers, the factors are chosen by each
    sequence's length (llama.cpp chooses them by the context size it was started with)."""
    tensors = {tensor.name: tensor for tensor in reader.tensors if tensor.name in _LONGROPE_TENSORS}
    original = _field(reader, prefix + "rope.scaling.original_context_length")
    attn_factor = _field(reader, prefix + "rope.scaling.attn_factor")
    if not tensors and original is None and attn_factor is None:
        return
    if len(tensors) != len(_LONGROPE_TENSORS) or original is None:
        raise ValueError(
            "the GGUF file has part of Phi-3's LongRoPE (the rope_factors_short / rope_factors_long tensors "
            f"and {prefix}rope.scaling.original_context_length go together): refusing to run without the rest"
        )
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.update(rope_type="longrope", original_max_position_embeddings=int(original))
    for name, key in _LONGROPE_TENSORS.items():
        tensor = tensors[name]
        if GGMLQuantizationType(tensor.tensor_type) != GGMLQuantizationType.F32:
            raise ValueError(f"the GGUF file's {name} is {tensor.tensor_type!r}, not float32")
        params[key] = [float(value) for value in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]
    if attn_factor is not None:
        params["attention_factor"] = float(attn_factor)
    config.rope_parameters = params


def _gemma3_global_rope(config: Any, reader: GGUFReader, prefix: str) -> None:
    """Gemma 3's global layers' rotary scaling, which transformers' config drops: llama.cpp
    writes it as ``rope.scaling.type`` (only ``linear``) and ``.factor``, for the global layers
    alone. The local layers' base (10,000) and their pattern (five local layers, then a global
    one) are llama.cpp's fixed ones, and transformers' defaults for the config."""
    kind = _field(reader, prefix + "rope.scaling.type")
    if kind is None or str(kind) == "none":
        return
    if str(kind) != "linear":
        raise ValueError(f"the GGUF file's {prefix}rope.scaling.type is {kind!r}: pagedrs runs Gemma 3 with 'linear'")
    factor = _field(reader, prefix + "rope.scaling.factor")
    if factor is None:
        raise ValueError(f"the GGUF file has {prefix}rope.scaling.type linear but no {prefix}rope.scaling.factor")
    params = dict(config.rope_parameters)
    params["full_attention"] = {**params["full_attention"], "rope_type": "linear", "factor": float(factor)}
    config.rope_parameters = params


class GGUFCheckpoint:
    """The tensors of a GGUF file by Hugging Face name (lazy handles over one memory map)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        reader = open_reader(self.path)
        self.architecture = str(_field(reader, "general.architecture"))
        check_metadata(reader, self.architecture)
        num_heads = _field(reader, f"{self.architecture}.attention.head_count")
        num_kv_heads = _field(reader, f"{self.architecture}.attention.head_count_kv") or num_heads
        self.tensors: dict[str, GGUFTensor] = {}
        for tensor in reader.tensors:
            if self.architecture == "phi3" and tensor.name in _LONGROPE_TENSORS:
                continue  # the rotary's factors: read into the config (`complete_config`)
            name = hf_name(tensor.name, self.architecture)
            row_order = None
            # transformers' LlamaTensorProcessor: `llama` is permuted (and, by llama.cpp's
            # converter, `granite`).
            if self.architecture in _PERMUTED_QK and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
                heads = num_heads if ".attn_q." in tensor.name else num_kv_heads
                row_order = rotary_row_order(int(tensor.shape[-1]), int(heads))
            plus_one = self.architecture in _NORMS_PLUS_ONE and name.endswith("norm.weight")
            self.tensors[name] = GGUFTensor(name, tensor, row_order, offset=-1.0 if plus_one else 0.0)

    def __iter__(self) -> Iterator[tuple[str, GGUFTensor]]:
        return iter(self.tensors.items())

    def ggml_types(self) -> dict[str, GGMLQuantizationType]:
        """Each tensor's stored type, by Hugging Face name (to choose the linears before loading)."""
        return {name: handle.ggml_type for name, handle in self.tensors.items()}
