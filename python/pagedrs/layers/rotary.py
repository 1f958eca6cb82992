"""Rotary position embeddings (the "rotate half" layout of Llama, Mistral and Qwen)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_theta(config: Any) -> float:
    """The rotary base from a Hugging Face config (``rope_parameters`` in transformers 5,
    ``rope_theta`` before); only the default rotary type is supported."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} is not supported yet (only 'default')")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("the model config has no rope_theta")
    return float(theta)


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor
    """``float32 [head_dim / 2]``, a non-persistent buffer (so it follows ``.to(device)``)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_tokens, head_dim]`` cos and sin for the given positions (computed once per
        step and shared by every layer)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: ``[num_tokens, num_heads, head_dim]``; cos/sin: ``[num_tokens, head_dim]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
