"""Which weights a model holds packed, decided by the loader (the model code asks for plain
linears): ``quantization="auto"`` keeps a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensors as stored, ``"none"``
dequantizes everything to the model's dtype, ``"int8"`` quantizes a float checkpoint's linears
and embedding to Q8_0 blocks at load time. Packed weights run on the CPU kernel only; on other
devices ``auto`` is ``none``.

FP8 (`pagedrs.quant.fp8`, any device): ``"auto"`` keeps an FP8 checkpoint's e4m3 linears
(``quantization_config`` with quant_method ``fp8`` or ``compressed-tensors``) with per-channel
or per-tensor scales and loads block-wise ones (``weight_block_size``) dequantized, ``"fp8"``
quantizes every linear per channel at load time (a float checkpoint's, or a block-wise one's
dequantized values); embeddings and the head stay in the model's dtype, as vLLM keeps them.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedrs.checkpoint import ModelSource, ggml_blocks, iter_weights
from pagedrs.checkpoint.gguf import GGUFCheckpoint
from pagedrs.kernels import cpu as cpu_kernels
from pagedrs.layers.linear import ColumnParallelLinear, RowParallelLinear, VocabEmbedding
from pagedrs.layers.moe import FusedExperts
from pagedrs.quant import QUANTIZATION_CHOICES
from pagedrs.quant.fp8 import (
    SCALE_SUFFIXES,
    Fp8ColumnParallelLinear,
    Fp8RowParallelLinear,
    Fp8Scheme,
    checkpoint_scheme,
    fp8_weight_names,
    iter_fp8_weights,
)
from pagedrs.quant.layers import (
    QuantColumnParallelLinear,
    QuantFusedExperts,
    QuantRowParallelLinear,
    QuantVocabEmbedding,
    fits_row_shard,
)

logger = logging.getLogger("pagedrs")

# A fused module's checkpoint tensors: pagedrs fuses q/k/v and gate/up into one linear.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def check_quantization(quantization: str) -> str:
    """``quantization`` if it is one pagedrs knows; else ``ValueError``."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}")
    return quantization


def checkpoint_names(module_name: str, stored: Mapping[str, object] | None = None) -> list[str]:
    """The checkpoint weights (Hugging Face names) a pagedrs module is loaded from: a fused
    module from its parts, unless the checkpoint (``stored``: its names) keeps it fused too
    (Phi-3's)."""
    if stored is not None and f"model.{module_name}.weight" in stored:
        return [f"model.{module_name}.weight"]
    if module_name in ("embed_tokens", "lm_head"):
        return [f"model.{module_name}.weight" if module_name == "embed_tokens" else "lm_head.weight"]
    for fused, parts in _FUSED.items():
        if module_name.endswith("." + fused):
            prefix = module_name.removesuffix(fused)
            return [f"model.{prefix}{part}.weight" for part in parts]
        if module_name.endswith(".shared_expert." + fused.split(".")[-1]):  # Qwen2-MoE's shared expert
            prefix = module_name.removesuffix(fused.split(".")[-1])
            return [f"model.{prefix}{part.split('.')[-1]}.weight" for part in parts]
    return [f"model.{module_name}.weight"]


def _chosen_type(
    names: list[str], quantization: str, ggml_types: Mapping[str, GGMLQuantizationType] | None
) -> GGMLQuantizationType | None:
    if quantization == "int8":
        return GGMLQuantizationType.Q8_0
    if quantization == "none" or ggml_types is None:
        return None
    types = {ggml_types.get(name) for name in names}
    only = types.pop() if len(types) == 1 else None
    return only if only in ggml_blocks.KERNEL_TYPES else None


def pack_linears(
    model: nn.Module,
    quantization: str,
    ggml_types: Mapping[str, GGMLQuantizationType] | None,
    device: torch.device,
) -> dict[str, GGMLQuantizationType]:
    """Replaces the model's dense linears and embeddings by packed ones where ``quantization``
    and the checkpoint's stored types (``ggml_types``: by Hugging Face name, ``None`` for a float
    checkpoint) call for it, before any weight is loaded. Returns the packed modules' types."""
    check_quantization(quantization)
    if quantization in ("int8", "fp8") and ggml_types is not None:
        raise ValueError(
            f"quantization={quantization!r} quantizes a float (safetensors) checkpoint; a GGUF model keeps "
            "its own format with quantization='auto'"
        )
    if quantization == "none" or (quantization == "auto" and ggml_types is None):
        return {}
    if device.type != "cpu" or not cpu_kernels.available():
        if quantization == "int8":
            raise ValueError("quantization='int8' runs on the CPU kernel: use device='cpu'")
        logger.info("packed weights need the CPU kernel; %s loads dequantized", device)
        return {}
    packed: dict[str, GGMLQuantizationType] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, FusedExperts):
            experts = _packed_experts(module, name, quantization, ggml_types)
            if experts is not None:
                model.set_submodule(name, experts)
                packed[name] = GGMLQuantizationType(experts.gate_up_type)
            continue
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabEmbedding)):
            continue
        ggml_type = _chosen_type(checkpoint_names(name, ggml_types), quantization, ggml_types)
        if ggml_type is None:
            continue
        replacement: nn.Module
        if isinstance(module, ColumnParallelLinear):
            if not ggml_blocks.fits_blocks(ggml_type, module.weight.shape[1]):
                continue
            replacement = QuantColumnParallelLinear(module, ggml_type)
        elif isinstance(module, RowParallelLinear):
            if not fits_row_shard(module, ggml_type):
                continue
            replacement = QuantRowParallelLinear(module, ggml_type)
        else:
            if not ggml_blocks.fits_blocks(ggml_type, module.weight.shape[1]):
                continue
            replacement = QuantVocabEmbedding(module, ggml_type)
        model.set_submodule(name, replacement)
        packed[name] = ggml_type
    return packed


def expert_checkpoint_names(module_name: str) -> tuple[list[str], list[str]]:
    """The stacked checkpoint tensors (GGUF's ``ffn_*_exps``, by Hugging Face name) of a
    mixture's experts: its gate and up projections, and its down projection."""
    prefix = f"model.{module_name}"
    return [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"], [f"{prefix}.down_proj.weight"]


def _packed_experts(
    module: FusedExperts, name: str, quantization: str, ggml_types: Mapping[str, GGMLQuantizationType] | None
) -> QuantFusedExperts | None:
    """The packed form of a mixture's experts, where both projections' types are kernel
    formats whose blocks fit this rank's shard; else ``None`` (they load dense)."""
    gate_up_names, down_names = expert_checkpoint_names(name)
    gate_up_type = _chosen_type(gate_up_names, quantization, ggml_types)
    down_type = _chosen_type(down_names, quantization, ggml_types)
    if gate_up_type is None or down_type is None:
        return None
    fits = ggml_blocks.fits_blocks(gate_up_type, module.hidden_size)
    if not fits or not ggml_blocks.fits_blocks(down_type, module.intermediate_size):
        return None
    return QuantFusedExperts(module, gate_up_type, down_type)


def makes_fp8_linears(quantization: str, scheme: Fp8Scheme | None) -> bool:
    """Whether `load_weights` replaces a safetensors checkpoint's linears by FP8 ones: always
    under ``"fp8"``; under ``"auto"`` for an FP8 checkpoint whose scales the FP8 layers hold as
    stored (not block-wise: those load dense, dequantized)."""
    return quantization == "fp8" or (quantization == "auto" and scheme is not None and scheme.per_channel)


def use_fp8_linears(model: nn.Module, quantization: str, fp8_names: set[str]) -> dict[str, str]:
    """Replaces the model's dense linears by FP8 ones before any weight is loaded: under
    ``"auto"`` those whose checkpoint weights (``fp8_names``: by Hugging Face name) are all
    stored as e4m3, under ``"fp8"`` every one. Returns the replaced modules' names (-> "fp8")."""
    replaced = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        if quantization == "auto" and not all(part in fp8_names for part in checkpoint_names(name)):
            continue
        if isinstance(module, ColumnParallelLinear):
            model.set_submodule(name, Fp8ColumnParallelLinear(module))
        else:
            model.set_submodule(name, Fp8RowParallelLinear(module))
        replaced[name] = "fp8"
    return replaced


def load_weights(
    model: Any, source: ModelSource, quantization: str, device: torch.device
) -> dict[str, GGMLQuantizationType | str]:
    """Loads ``source``'s weights into ``model`` (built by `pagedrs.models.build_model`), packed
    where `pack_linears` decides, FP8 where `use_fp8_linears` does; returns the packed modules'
    types (``"fp8"`` for FP8 ones). A GGUF file is read through one memory map, each rank
    reading only its slices."""
    check_quantization(quantization)
    if source.gguf_file is not None:
        if quantization in ("int8", "fp8"):
            pack_linears(model, quantization, {}, device)  # refuses it, before the file is read
        checkpoint = GGUFCheckpoint(os.path.join(source.directory, source.gguf_file))
        packed = pack_linears(model, quantization, checkpoint.ggml_types(), device)
        model.load_weights(iter(checkpoint))
        return dict(packed)
    scheme = checkpoint_scheme(source.directory)
    if scheme is not None or quantization == "fp8":
        if quantization == "int8":
            raise ValueError(
                "quantization='int8' quantizes a float checkpoint; an FP8 checkpoint keeps its own format "
                "with quantization='auto' (or loads dequantized with 'none')"
            )
        replaced = {}
        if makes_fp8_linears(quantization, scheme):
            fp8_names = fp8_weight_names(source.directory) if scheme is not None else set()
            replaced = use_fp8_linears(model, quantization, fp8_names)
        elif quantization == "auto":
            logger.info("block-wise FP8 weights (weight_block_size) load dequantized to the model's dtype")
        model.load_weights(iter_fp8_weights(source.directory, scheme) if scheme is not None else iter_weights(source))
        return dict(replaced)
    packed = pack_linears(model, quantization, None, device)
    model.load_weights(iter_weights(source))
    return dict(packed)


def predicted_weight_bytes(source: ModelSource, quantization: str, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes the loaded weights of the whole, unsharded model take (what one process holds at
    tensor-parallel size 1; at size ``tp`` each rank holds about ``1 / tp`` of the linears and
    embeddings, plus the replicated norms and row-parallel biases), from the checkpoint's tensor
    types and shapes without loading it: packed blocks where `pack_linears` packs (a kernel
    format of a 2-D GGUF tensor under ``auto``; a 2-D float weight as Q8_0 under ``int8``), one
    byte a weight plus a float32 scale a row where `use_fp8_linears` makes FP8 linears (an e4m3
    weight with per-channel or per-tensor scales under ``auto``, every linear's weight under
    ``fp8``), ``dtype`` elsewhere (block-wise FP8 under ``auto`` loads dequantized, and so does
    a fused q/k/v or gate/up whose parts are stored in different types). A ``.bin`` checkpoint
    counts its files' size."""
    check_quantization(quantization)
    element = torch.empty((), dtype=dtype).element_size()
    packs = quantization != "none" and device.type == "cpu" and cpu_kernels.available()
    total = 0
    if source.gguf_file is not None:
        handles = dict(GGUFCheckpoint(os.path.join(source.directory, source.gguf_file)))
        for name, handle in handles.items():
            numel = int(np.prod(handle.shape))
            kept = packs and quantization == "auto" and handle.ggml_type in ggml_blocks.KERNEL_TYPES
            # a matrix, or a mixture's stacked experts (GGUF's ffn_*_exps)
            kept = kept and (len(handle.shape) == 2 or (len(handle.shape) == 3 and ".mlp.experts." in name))
            kept = kept and ggml_blocks.fits_blocks(handle.ggml_type, handle.shape[-1])
            kept = kept and len({handles[part].ggml_type for part in _fused_parts(name) if part in handles}) <= 1
            total += handle.nbytes if kept else numel * element
        return total
    from safetensors import safe_open

    safetensors = glob.glob(os.path.join(source.directory, "*.safetensors"))
    if not safetensors:  # a pytorch_model*.bin checkpoint: its tensors' sizes on disk
        bins = glob.glob(os.path.join(source.directory, "pytorch_model*.bin"))
        return sum(os.path.getsize(path) for path in bins)
    scheme = checkpoint_scheme(source.directory)
    fp8_layers = makes_fp8_linears(quantization, scheme)
    q8_bytes_per_weight = ggml_blocks.block_bytes(GGMLQuantizationType.Q8_0) / ggml_blocks.BLOCK_SIZE
    for path in sorted(safetensors):
        with safe_open(path, framework="pt") as file:
            for name in file.keys():
                if scheme is not None and name.endswith(SCALE_SUFFIXES):
                    continue  # folded into the weight (its per-row scales are counted there)
                tensor = file.get_slice(name)
                shape = tensor.get_shape()
                numel = int(np.prod(shape))
                if name.endswith(("_blocks", "_scales")) and tensor.get_dtype() == "U8":  # MXFP4 experts
                    total += 2 * numel * element if name.endswith("_blocks") else 0  # two weights a byte
                    continue
                if (
                    fp8_layers
                    and _is_linear_weight(name)
                    and (quantization == "fp8" or tensor.get_dtype() == "F8_E4M3")
                ):
                    total += numel + 4 * shape[0]
                    continue
                packed = packs and quantization == "int8" and len(shape) == 2 and shape[1] % ggml_blocks.BLOCK_SIZE == 0
                total += int(numel * q8_bytes_per_weight) if packed else numel * element
    return total


def _fused_parts(name: str) -> tuple[str, ...]:
    """The checkpoint names loaded into the same fused linear as ``name`` (itself included);
    ``()`` for a tensor no fused linear holds."""
    for parts in _FUSED.values():
        for part in parts:
            suffix = f".{part}.weight"
            if name.endswith(suffix):
                prefix = name.removesuffix(suffix)
                return tuple(f"{prefix}.{other}.weight" for other in parts)
    return ()


def _is_linear_weight(name: str) -> bool:
    """Whether a checkpoint tensor is a decoder layer's linear weight (what FP8 replaces)."""
    parts = name.split(".")
    linears = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    return name.startswith("model.layers.") and parts[-1] == "weight" and parts[-2] in linears
