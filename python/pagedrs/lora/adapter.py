"""LoRA adapters: peft checkpoints read and checked against the base model's layers.

An adapter adds a low-rank update to some of each decoder layer's linears:
``y = W x + s * B (A x)``, ``A`` of ``[r, in]``, ``B`` of ``[out, r]``, ``s = lora_alpha / r``
(rsLoRA: ``lora_alpha / sqrt(r)``; peft's ``rank_pattern`` / ``alpha_pattern`` set them per
module). The scale is folded into ``B`` at load.

Our layers fuse q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (`pagedrs.models.decoder`):
an adapter's ``q_proj``, ``k_proj`` and ``v_proj`` (or Phi-3's fused ``qkv_proj``) patch slices
of ``qkv_proj``'s outputs, each with its own ``A`` and ``B``; ``gate_proj`` / ``up_proj`` likewise
for ``gate_up_proj``. Whatever the adapter holds is checked against the base model's shapes
before any of it is used: an adapter for another model, a rank above ``max_lora_rank``, a
module we do not patch (embeddings, the LM head, experts) or a setting peft applies and we would
not (biases, DoRA, ``modules_to_save``) is a `ValueError` naming it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pagedrs.models.decoder import DecoderForCausalLM

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""The decoder layer's linears an adapter may patch, in the order `LoRAAdapter.layers` keys them."""

_MODULES = {  # a peft module's name -> (our linear, its output slice, or None: the whole linear)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "qkv_proj": ("qkv_proj", None),
    "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "gate_up_proj": ("gate_up_proj", None),
    "down_proj": ("down_proj", None),
}
_PARENTS = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.(?:default\.)?weight$"
)
"""peft's tensor names: ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``."""

_REFUSED_SETTINGS = {
    "use_dora": "DoRA adapters",
    "modules_to_save": "modules_to_save (whole modules trained beside the adapter)",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2's Conv1D layout)",
    "trainable_token_indices": "trainable token embeddings",
}


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's `LoRARequest`: which adapter a request runs with. ``lora_int_id`` (at least 1)
    names the adapter everywhere (slots, the prefix cache); ``lora_path`` is the peft checkpoint
    directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer of at least 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise ValueError(f"lora_path must be a path, got {self.lora_path!r}")


@dataclass
class LoRAWeights:
    """One patched linear's update: per output slice of the linear (q, k, v; gate, up; or the
    whole), ``a[j]`` of ``[r_j, in]`` and ``b[j]`` of ``[out_j, r_j]`` (scale folded in), or
    ``None`` where the adapter leaves that slice alone."""

    output_sizes: list[int]
    a: list[torch.Tensor | None]
    b: list[torch.Tensor | None]

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``s * B (A x)`` of ``x`` (``[tokens, in]``) over the linear's whole output: the
        reference every faster path is checked against."""
        parts = []
        for size, a, b in zip(self.output_sizes, self.a, self.b):
            if a is None or b is None:
                parts.append(x.new_zeros(x.shape[0], size))
            else:
                parts.append((x @ a.T) @ b.T)
        return torch.cat(parts, dim=-1)

    @property
    def rank(self) -> int:
        return max((a.shape[0] for a in self.a if a is not None), default=0)


@dataclass
class LoRAAdapter:
    """An adapter read for one base model: its updates keyed by ``(layer index, linear)``."""

    name: str
    path: str
    rank: int
    """The largest rank of any of its modules."""
    layers: dict[tuple[int, str], LoRAWeights] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for w in self.layers.values() for t in (*w.a, *w.b) if t is not None)


def _read_config(path: str) -> dict[str, Any]:
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path!r} is not a directory")
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {path!r} has no adapter_config.json (a peft checkpoint has one)")
    try:
        with open(config_path) as file:
            config = json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is not readable JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is not an object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {path!r} is a {peft_type} adapter, not LORA")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r} trains biases (bias={config['bias']!r}); only bias='none' is served")
    for key, what in _REFUSED_SETTINGS.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {path!r} uses {what}, which is not served")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"LoRA adapter {path!r}: {key} must be a positive number, got {value!r}")
    return config


def _pattern(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """peft's per-module override (``rank_pattern`` / ``alpha_pattern``): the first key that
    matches the end of the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise ValueError(
                f"LoRA adapter {path!r} is stored as adapter_model.bin (pickle), which is not loaded: "
                "save it with safetensors (peft's default)"
            )
        raise ValueError(f"LoRA adapter {path!r} has no adapter_model.safetensors")
    return load_file(weights)


@dataclass(frozen=True)
class _Shard:
    """A patched linear's shapes, whole (what a peft checkpoint holds) and this
    tensor-parallel rank's part of them. Column-parallel linears (``qkv_proj``,
    ``gate_up_proj``) split their outputs: ``B`` keeps this rank's rows of each slice and ``A``
    is whole. Row-parallel ones (``o_proj``, ``down_proj``) split their inputs: ``A`` keeps this
    rank's columns, ``B`` is whole, and the ranks' shrunk activations are summed before the
    expand (`LoRASlots.add`)."""

    in_size: int
    output_sizes: list[int]
    rows: list[slice]
    """Per output slice: this rank's rows of it."""
    cols: slice
    """This rank's input columns."""

    @property
    def local_in(self) -> int:
        return self.cols.stop - self.cols.start

    @property
    def local_outputs(self) -> list[int]:
        return [part.stop - part.start for part in self.rows]

    @property
    def row_parallel(self) -> bool:
        return self.local_in != self.in_size


def _shard(model: DecoderForCausalLM, layer: int, linear: str) -> _Shard:
    """The base linear's shapes (whatever its weights' format: dense or packed), or a
    ValueError when we do not patch it."""
    from pagedrs.models.decoder import MLP, Attention

    decoder_layer = model.decoder_layers()[layer]
    hidden, tp = int(model.config.hidden_size), model.tp
    whole = slice(0, hidden)

    def split(local: int, replicas: int = 1) -> slice:
        index = tp.rank // replicas
        return slice(index * local, (index + 1) * local)

    if linear in ("qkv_proj", "o_proj"):
        attn = decoder_layer.self_attn
        if not isinstance(attn, Attention):
            raise ValueError(f"layer {layer}'s attention is not patched by LoRA (latent attention)")
        q_local, kv_local = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        num_kv_heads = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
        kv_replicas = tp.replicas(int(num_kv_heads), "num_key_value_heads")
        q_size, kv_size = q_local * tp.size, kv_local * tp.size // kv_replicas
        if linear == "o_proj":
            return _Shard(q_size, [hidden], [whole], split(q_local))
        kv_rows = split(kv_local, kv_replicas)
        return _Shard(hidden, [q_size, kv_size, kv_size], [split(q_local), kv_rows, kv_rows], whole)
    mlp = decoder_layer.mlp
    if not isinstance(mlp, MLP):
        raise ValueError(f"layer {layer}'s MLP is a mixture of experts, which LoRA does not patch")
    local = mlp.intermediate_size
    if linear == "gate_up_proj":
        return _Shard(hidden, [local * tp.size] * 2, [split(local)] * 2, whole)
    return _Shard(local * tp.size, [hidden], [whole], split(local))


def _base_shapes(model: DecoderForCausalLM, layer: int, linear: str) -> tuple[int, list[int]]:
    """This rank's input size and output slices of the base linear (the whole linear's
    without tensor parallelism), or a ValueError when we do not patch it."""
    shard = _shard(model, layer, linear)
    return shard.local_in, shard.local_outputs


def load_adapter(request: LoRARequest, model: DecoderForCausalLM, max_lora_rank: int) -> LoRAAdapter:
    """Reads ``request``'s peft checkpoint for ``model``'s layers (in the model's dtype, on
    the CPU); every tensor is checked before the adapter is returned."""
    path = os.fspath(request.lora_path)
    config = _read_config(path)
    tensors = _read_tensors(path)
    if not tensors:
        raise ValueError(f"LoRA adapter {path!r} holds no tensors")
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    num_layers = len(model.decoder_layers())
    for name, tensor in tensors.items():
        match = _KEY.match(name)
        if match is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name!r} does not patch a decoder layer's linear")
        layer, parent, module, side = int(match[1]), match[2], match[3], match[4]
        if module not in _MODULES or _PARENTS[_MODULES[module][0]] != parent:
            raise ValueError(f"LoRA adapter {path!r}: {parent}.{module} is not a linear LoRA patches here")
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} does not exist (the model has {num_layers})")
        found.setdefault((layer, module), {})[side] = tensor
    adapter = LoRAAdapter(request.lora_name, path, rank=0)
    dtype = model.norm.weight.dtype  # the activations' (packed weights are bytes)
    for (layer, module), sides in sorted(found.items()):
        if set(sides) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: layers.{layer}.{module} has lora_A or lora_B but not both")
        a, b = sides["A"].float(), sides["B"].float()
        rank = a.shape[0]
        linear, slice_index = _MODULES[module]
        shard = _shard(model, layer, linear)
        in_size, output_sizes = shard.in_size, shard.output_sizes
        out_size = sum(output_sizes) if slice_index is None else output_sizes[slice_index]
        where = f"LoRA adapter {path!r}: layers.{layer}.{module}"
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, in_size) or tuple(b.shape) != (out_size, rank):
            raise ValueError(
                f"{where} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; this model needs "
                f"[r, {in_size}] and [{out_size}, r]: the adapter was trained for another model"
            )
        if rank > max_lora_rank:
            raise ValueError(f"{where} has rank {rank}, above max_lora_rank ({max_lora_rank})")
        full_name = f"model.layers.{layer}.{_PARENTS[linear]}.{module}"
        r = _pattern(config.get("rank_pattern") or {}, full_name, config["r"])
        alpha = _pattern(config.get("alpha_pattern") or {}, full_name, config["lora_alpha"])
        if r != rank:
            raise ValueError(f"{where} has rank {rank}, but its config says {r}")
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        weights = adapter.layers.get((layer, linear))
        if weights is None:
            weights = adapter.layers[(layer, linear)] = LoRAWeights(
                shard.local_outputs, [None] * len(output_sizes), [None] * len(output_sizes)
            )
        slices = range(len(output_sizes)) if slice_index is None else [slice_index]
        if any(weights.a[j] is not None for j in slices):
            raise ValueError(f"{where} patches outputs another of its modules patches too")
        if slice_index is None and len(output_sizes) > 1:
            # A fused module (Phi-3's qkv_proj): one A for every slice, B cut by output rows.
            starts = [sum(output_sizes[:j]) for j in range(len(output_sizes))]
            parts = {j: b[start : start + size] for j, (start, size) in enumerate(zip(starts, output_sizes))}
        else:
            parts = {0 if slice_index is None else slice_index: b}
        for j, part in parts.items():
            # This rank's part: its input columns of A, its rows of each slice of B.
            weights.a[j] = a[:, shard.cols].to(dtype).contiguous()
            weights.b[j] = (part[shard.rows[j]] * scale).to(dtype).contiguous()
        adapter.rank = max(adapter.rank, rank)
    return adapter
