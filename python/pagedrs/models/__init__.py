"""Model architectures pagedrs runs, chosen from a checkpoint's config."""

from __future__ import annotations

from typing import Any

import torch

from pagedrs.layers.linear import TensorParallel
from pagedrs.models.llama import LlamaFamilyForCausalLM

# architecture name -> (attention q/k/v biases, per-head q/k norm)
_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)


def architecture_of(config: Any) -> str:
    """The architecture named by ``config.architectures`` (or, for GGUF files, which carry
    none, by ``config.model_type``)."""
    names = list(getattr(config, "architectures", None) or [])
    if not names and getattr(config, "model_type", None) in _MODEL_TYPES:
        names = [_MODEL_TYPES[config.model_type]]
    for name in names:
        if name in _ARCHITECTURES:
            return name
    raise ValueError(
        f"unsupported model architecture {names or getattr(config, 'model_type', None)!r}; "
        f"pagedrs supports {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def build_model(config: Any, dtype: torch.dtype, tp: TensorParallel | None = None) -> LlamaFamilyForCausalLM:
    bias, qk_norm = _ARCHITECTURES[architecture_of(config)]
    bias = bias or bool(getattr(config, "attention_bias", False))
    return LlamaFamilyForCausalLM(config, dtype, tp or TensorParallel(), bias=bias, qk_norm=qk_norm)
