"""DeepSeek-V2/V3's multi-head latent attention (MLA), on the paged cache.

Each token's keys and values are compressed into one latent vector (``kv_lora_rank``
features, after an RMSNorm) plus one rotary key shared by every head (``qk_rope_head_dim``);
each head's key and value are up-projections of the latent (``kv_b_proj``). The cache holds
only what every head shares, ``kv_lora_rank + qk_rope_head_dim`` features per token as one
"head" (576 for the released models, against ``2 * heads * head size`` for plain attention):
the key cache, and the value cache is the same tensor (`ModelRunner` allocates it so).

Attention absorbs the up-projections, as vLLM's MLA backends do: a head's score of a key is
``q_nope . (W_UK latent) + q_rope . k_rope = (W_UK^T q_nope) . latent + q_rope . k_rope``, so
each query is mapped into the latent space once and attends over the cached latents directly
(one key head, multi-query attention with 576-wide heads); the heads' outputs are latent
mixtures, mapped to values by ``W_UV`` after the softmax. Decode reads only the latents. (The
paged kernels take the value as the whole cached row, latent and rotary key both: the rotary
part of the output is dropped, 64 of 576 columns of extra arithmetic, no extra memory.)

Prefill runs the same absorbed form (vLLM expands the latents for long prefills instead: fewer
flops per token, not fewer bytes; a measured reason would be needed to add the second path).
Tensor parallelism splits the heads (their query rows, their part of ``kv_b_proj``, their
columns of ``o_proj``); the latent projection is replicated, so every rank caches every latent.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedrs.attention import AttentionMetadata
from pagedrs.checkpoint import WeightHandle
from pagedrs.layers.linear import ColumnParallelLinear, RowParallelLinear, TensorParallel
from pagedrs.layers.norm import RMSNorm
from pagedrs.layers.rotary import apply_rotary, yarn_mscale

LATENT_NORM_EPS = 1e-6
"""The eps of the q and kv latents' RMSNorms: transformers builds them with the default, not
``rms_norm_eps``."""


def latent_width(config: Any) -> int:
    """Features one token caches per layer: ``kv_lora_rank + qk_rope_head_dim``."""
    return int(config.kv_lora_rank) + int(config.qk_rope_head_dim)


def latent_scale(config: Any) -> float:
    """The softmax scale: ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times YaRN's
    ``mscale(factor, mscale_all_dim) ** 2`` when the rotary is YaRN with ``mscale_all_dim``
    (as transformers' DeepSeek models apply it)."""
    scale = (int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)) ** -0.5
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    all_dim = params.get("mscale_all_dim")
    factor = float(params.get("factor") or 1.0)
    if params.get("rope_type", "default") != "default" and all_dim:
        scale *= yarn_mscale(factor, float(all_dim)) ** 2
    return scale


def _interleaved_to_halves(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek rotates adjacent feature pairs ``(x0, x1), (x2, x3), ...``; the same rotation on
    the features reordered as ``evens, odds`` is the half-split form `apply_rotary` computes.
    Queries and keys are reordered alike, so their dot products are unchanged."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    """One layer's multi-head latent attention; ``forward`` as `pagedrs.models.decoder.Attention`'s,
    over a latent cache pair (key and value the same ``[blocks, block_size, 1, latent]`` tensor)."""

    def __init__(self, config: Any, scale: float, tp: TensorParallel, dtype: torch.dtype):
        super().__init__()
        self.scale = scale
        self.num_heads = tp.split(config.num_attention_heads, "num_attention_heads")
        self.nope_dim, self.rope_dim = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
        self.value_dim, self.rank = int(config.v_head_dim), int(config.kv_lora_rank)
        self.heads = slice(tp.rank * self.num_heads, (tp.rank + 1) * self.num_heads)
        # DeepSeek-V2 always rotates interleaved pairs; V3 as `rope_interleave` says.
        self.interleaved = bool(getattr(config, "rope_interleave", True))
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        q_size = config.num_attention_heads * (self.nope_dim + self.rope_dim)
        q_rank = getattr(config, "q_lora_rank", None)
        self.q_a_proj: ColumnParallelLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        if q_rank:
            # The query's own latent, replicated: every rank needs all of it.
            self.q_a_proj = ColumnParallelLinear(hidden, [int(q_rank)], bias, tp, dtype, replicas=[tp.size])
            self.q_a_layernorm = RMSNorm(int(q_rank), LATENT_NORM_EPS, dtype)
        self.q_proj = ColumnParallelLinear(int(q_rank) if q_rank else hidden, [q_size], False, tp, dtype)
        """``q_b_proj`` where the query has a latent, else ``q_proj``: this rank's heads."""
        self.kv_a_proj_with_mqa = ColumnParallelLinear(
            hidden, [self.rank + self.rope_dim], bias, tp, dtype, replicas=[tp.size]
        )
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, dtype)
        self.kv_b = nn.Parameter(
            torch.empty(self.num_heads, self.nope_dim + self.value_dim, self.rank, dtype=dtype), requires_grad=False
        )
        """``kv_b_proj`` as this rank's heads' ``[W_UK; W_UV]`` (``[H, nope + v, rank]``), kept
        dense: it is multiplied in as two batched matmuls, never as a linear."""
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.value_dim, hidden, bias, tp, dtype)

    def norms(self) -> dict[str, RMSNorm | None]:
        """The attention's norms by checkpoint name (relative to ``self_attn``)."""
        return {"q_a_layernorm": self.q_a_layernorm, "kv_a_layernorm": self.kv_a_layernorm}

    def load(self, rest: str, kind: str, tensor: WeightHandle) -> str | None:
        """Loads the attention's checkpoint tensor ``self_attn.<rest>.<kind>``; returns the
        parameter's name relative to the layer, or ``None`` when it is not one of them."""
        if rest == "kv_b_proj" and kind == "weight":
            width = self.nope_dim + self.value_dim
            rows = slice(self.heads.start * width, self.heads.stop * width)
            self.kv_b.copy_(tensor[rows].reshape(self.num_heads, width, self.rank))
            return "self_attn.kv_b"
        linears = {"q_a_proj": self.q_a_proj, "kv_a_proj_with_mqa": self.kv_a_proj_with_mqa}
        linears["q_b_proj" if self.q_a_proj is not None else "q_proj"] = self.q_proj
        linear = linears.get(rest)
        if linear is not None:
            (linear.load if kind == "weight" else linear.load_bias)(0, tensor)
            return f"self_attn.{'q_proj' if linear is self.q_proj else rest}.{kind}"
        if rest == "o_proj":
            (self.o_proj.load if kind == "weight" else self.o_proj.load_bias)(tensor)
            return f"self_attn.o_proj.{kind}"
        norm = self.norms().get(rest)
        if norm is not None and kind == "weight":
            norm.load(tensor)
            return f"self_attn.{rest}.weight"
        return None

    def forward(self, hidden, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q_input = hidden
        if self.q_a_proj is not None and self.q_a_layernorm is not None:
            q_input = self.q_a_layernorm(self.q_a_proj(hidden))
        q = self.q_proj(q_input).view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_rope = k_rope.unsqueeze(1)
        if self.interleaved:
            q_rope, k_rope = _interleaved_to_halves(q_rope), _interleaved_to_halves(k_rope)
        q_rope, k_rope = apply_rotary(q_rope, cos, sin), apply_rotary(k_rope, cos, sin)
        w_uk, w_uv = self.kv_b.split([self.nope_dim, self.value_dim], dim=1)
        # [H, T, nope] @ [H, nope, rank]: each head's query in the latent space.
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        query = torch.cat((q_latent, q_rope), dim=-1)
        key = torch.cat((latent.unsqueeze(1), k_rope), dim=-1)
        mixed = meta.attend(query, key, key, kv_cache[0], kv_cache[1], self.scale)
        # [H, T, rank] @ [H, rank, v]: each head's latent mixture as its value.
        values = torch.bmm(mixed[..., : self.rank].transpose(0, 1), w_uv.transpose(1, 2))
        return self.o_proj(values.transpose(0, 1).reshape(num_tokens, self.num_heads * self.value_dim))
