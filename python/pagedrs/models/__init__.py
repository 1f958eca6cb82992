"""Model architectures pagedrs runs, chosen from a checkpoint's config through the registry
(`pagedrs.models.registry`)."""

from __future__ import annotations

from typing import Any

import torch

from pagedrs.layers.linear import TensorParallel
from pagedrs.models.decoder import DecoderForCausalLM
from pagedrs.models.registry import SUPPORTED_ARCHITECTURES, architecture_of, model_class_of

__all__ = ["SUPPORTED_ARCHITECTURES", "DecoderForCausalLM", "architecture_of", "build_model"]


def build_model(config: Any, dtype: torch.dtype, tp: TensorParallel | None = None) -> DecoderForCausalLM:
    """The model for ``config`` (its weights not loaded); ``ValueError`` for an architecture or
    a setting pagedrs does not run."""
    cls = model_class_of(config)
    return cls(config, dtype, tp or TensorParallel())
