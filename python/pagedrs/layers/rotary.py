"""Rotary position embeddings (the "rotate half" layout of Llama, Qwen, Gemma, Phi), one small
class per variant of the Hugging Face config, built by `get_rope`:

- `RotaryEmbedding` (``default``), `LinearRope` (``linear``: positions divided by a factor),
  `Llama3Rope` (``llama3``: low frequencies divided, high kept, a smooth ramp between),
  `YarnRope` (``yarn``: a per-dimension ramp between interpolation and extrapolation, cos/sin
  times an attention factor);
- the length-dependent ones, whose frequencies follow the sequence's length: `DynamicNTKRope`
  (``dynamic``: the base grows past ``max_position_embeddings``) and `LongRope` (``longrope``,
  Phi-3: the short or the long per-dimension factors, by the length against
  ``original_max_position_embeddings``; cos/sin times an attention factor).

Any of them may rotate only the first ``partial_rotary_factor`` of each head (Phi-4-mini,
OLMo variants); the rest passes through.

NOTE: the length a length-dependent variant chooses by, for a token at position ``p`` of a
request whose prompt has ``P`` tokens, is ``max(P, p + 1)``: what transformers uses when it
generates (the whole prompt in one forward pass of ``P`` positions, then one forward pass per
token), whatever chunks the scheduler cuts the prompt into. Keys cached before the prompt's
length crossed a threshold keep the frequencies they were written with, exactly as there. Such
a prompt's keys depend on its length, so `RotaryEmbedding.cache_salt` keeps them from being
shared with requests whose length chooses differently.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

# Keys each type reads besides rope_type, rope_theta and partial_rotary_factor; any other key
# is refused (a setting pagedrs would ignore changes the model's computation).
_KEYS: dict[str, set[str]] = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor", "original_max_position_embeddings"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
    "longrope": {"factor", "original_max_position_embeddings", "attention_factor", "short_factor", "long_factor"},
}


def per_layer_type(config: Any) -> bool:
    """Whether ``config`` has one set of rotary settings per layer type (Gemma 3's
    ``sliding_attention`` and ``full_attention``)."""
    params = getattr(config, "rope_parameters", None) or {}
    return bool(params) and all(isinstance(value, dict) for value in params.values())


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rotary settings of ``config`` (of ``layer_type``'s layers, for models with one
    set per layer type, e.g. Gemma 3's ``sliding_attention`` and ``full_attention``):
    ``rope_parameters`` (transformers 5) or the legacy ``rope_scaling`` + ``rope_theta``;
    ``rope_type`` always set. Raises on a config without a rotary base."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if per_layer_type(config):
        if layer_type is None or layer_type not in params:
            raise ValueError(f"the config has rotary settings per layer type {sorted(params)}, none for {layer_type!r}")
        params = dict(params[layer_type])
    # Legacy configs only: transformers 5 answers `rope_scaling` with `rope_parameters` itself.
    merged = params or dict(getattr(config, "rope_scaling", None) or {})
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    merged["rope_type"] = rope_type
    merged.setdefault("rope_theta", getattr(config, "rope_theta", None))
    if merged["rope_theta"] is None:
        raise ValueError("the model config has no rope_theta")
    merged.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    original = getattr(config, "original_max_position_embeddings", None)
    if original is not None:
        merged.setdefault("original_max_position_embeddings", original)
    return merged


def model_positions(config: Any) -> int | None:
    """The longest sequence ``config``'s rotary scaling serves (vLLM's rule): past
    ``max_position_embeddings``, ``factor`` times more for ``linear`` and ``dynamic``, times
    ``original_max_position_embeddings`` for ``yarn``; ``max_position_embeddings`` for the
    rest (``llama3`` and ``longrope`` configs state the scaled length there already)."""
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is None or per_layer_type(config):
        return max_positions
    params = rope_parameters(config)
    factor = params.get("factor")
    if params["rope_type"] in ("linear", "dynamic") and factor:
        return int(max_positions * float(factor))
    if params["rope_type"] == "yarn" and factor and params.get("original_max_position_embeddings"):
        return int(params["original_max_position_embeddings"] * float(factor))
    return int(max_positions)


def get_rope(config: Any, head_dim: int, layer_type: str | None = None) -> RotaryEmbedding:
    """The rotary embedding ``config`` asks for (for ``layer_type``'s layers); ``ValueError``
    for a type or a setting pagedrs does not implement, before any weight is read."""
    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (pagedrs implements {', '.join(ROPE_TYPES)})")
    known = _KEYS[rope_type] | {"rope_type", "rope_theta", "partial_rotary_factor"}
    # original_max_position_embeddings: informational outside the types that read it.
    known |= {"original_max_position_embeddings"}
    unknown = {key for key, value in params.items() if key not in known and value is not None}
    if unknown:
        raise ValueError(f"rope type {rope_type!r}: settings {sorted(unknown)} are not supported")
    partial = float(params["partial_rotary_factor"])
    rotary_dim = int(head_dim * partial)
    if not 0 < partial <= 1 or rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor {partial} leaves an odd or empty rotary dimension of {head_dim}")
    theta = float(params["rope_theta"])
    max_positions = int(getattr(config, "max_position_embeddings", 0) or 0)
    cls: type[RotaryEmbedding] = {
        "default": RotaryEmbedding,
        "linear": LinearRope,
        "dynamic": DynamicNTKRope,
        "llama3": Llama3Rope,
        "yarn": YarnRope,
        "longrope": LongRope,
    }[rope_type]
    return cls(rotary_dim, theta, params, max_positions)


def _required(params: dict[str, Any], key: str) -> Any:
    value = params.get(key)
    if value is None:
        raise ValueError(f"rope type {params['rope_type']!r} needs {key!r} in the config")
    return value


class RotaryEmbedding(nn.Module):
    """The default rotary embedding over the first `rotary_dim` features of each head; the
    variants change `inv_freq` and `attention_factor`."""

    inv_freq: torch.Tensor
    """``float32 [rotary_dim / 2]``, a non-persistent buffer (so it follows ``.to(device)``)."""
    length_dependent = False
    """Whether the frequencies depend on the sequence's length (`cos_sin`'s ``lengths``)."""

    def __init__(self, rotary_dim: int, theta: float, params: dict[str, Any] | None = None, max_positions: int = 0):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.theta = theta
        self.attention_factor = 1.0
        """cos and sin are multiplied by it (YaRN's and LongRoPE's temperature)."""
        self.register_buffer("inv_freq", self.frequencies(params or {}, max_positions), persistent=False)

    def base_frequencies(self, theta: float | None = None) -> torch.Tensor:
        """``1 / theta^(2i / rotary_dim)``, computed as transformers computes it."""
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        return 1.0 / ((self.theta if theta is None else theta) ** exponents)

    def frequencies(self, params: dict[str, Any], max_positions: int) -> torch.Tensor:
        del params, max_positions
        return self.base_frequencies()

    def cache_salt(self, prompt_len: int) -> str | None:
        """What must join a request's cache salt so that it shares cached keys only with
        requests rotated the same way (``None``: nothing; see the module's note)."""
        del prompt_len
        return None

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_tokens, rotary_dim]`` cos and sin for the given positions (computed once per
        step and shared by every layer of this rotary type). ``lengths``: each token's
        sequence length (see the module's note), read by the length-dependent variants."""
        del lengths
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.unsqueeze(0)
        return self._cos_sin(freqs, dtype)

    def _cos_sin(self, freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


class LinearRope(RotaryEmbedding):
    """Position interpolation: every frequency divided by ``factor``."""

    def frequencies(self, params: dict[str, Any], max_positions: int) -> torch.Tensor:
        return self.base_frequencies() / float(_required(params, "factor"))


class Llama3Rope(RotaryEmbedding):
    """Llama 3.1's scaling: wavelengths past ``original / low_freq_factor`` divided by
    ``factor``, those under ``original / high_freq_factor`` kept, a linear ramp between."""

    def frequencies(self, params: dict[str, Any], max_positions: int) -> torch.Tensor:
        inv_freq = self.base_frequencies()
        factor = float(_required(params, "factor"))
        low, high = float(_required(params, "low_freq_factor")), float(_required(params, "high_freq_factor"))
        original = float(_required(params, "original_max_position_embeddings"))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, coefficient: float = 1.0) -> float:
    """YaRN's temperature for a context ``scale`` times the original: ``0.1 c ln(scale) + 1``."""
    return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0


class YarnRope(RotaryEmbedding):
    """YaRN: dimensions that rotate more than ``beta_fast`` times over the original context
    keep their frequency, those under ``beta_slow`` are interpolated by ``factor``, a linear
    ramp between; cos/sin scaled by the attention factor (``0.1 ln(factor) + 1`` unless
    given, or the ratio of two such with ``mscale`` / ``mscale_all_dim``)."""

    def frequencies(self, params: dict[str, Any], max_positions: int) -> torch.Tensor:
        original = int(_required(params, "original_max_position_embeddings"))
        factor = params.get("factor")
        factor = float(factor) if factor is not None else max_positions / original

        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            m, m_all = params.get("mscale"), params.get("mscale_all_dim")
            attention_factor = (
                yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
            )
        self.attention_factor = float(attention_factor)
        beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1
        dim, theta = self.rotary_dim, self.theta

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # no zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        base = theta ** (torch.arange(0, dim, 2).float() / dim)
        return (1.0 / (factor * base)) * (1 - extrapolation) + (1.0 / base) * extrapolation


class _LengthDependentRope(RotaryEmbedding):
    """Frequencies chosen per token by its sequence's length (see the module's note)."""

    length_dependent = True
    threshold: int
    """Lengths up to it rotate as the plain variant."""

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Without lengths (a decode-only CUDA graph), a token's length is its position + 1.
        lengths = positions + 1 if lengths is None else lengths
        freqs = positions.float().unsqueeze(-1) * self.frequencies_at(lengths)
        return self._cos_sin(freqs, dtype)

    def frequencies_at(self, lengths: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, rotary_dim / 2]``: each token's frequencies at its length."""
        raise NotImplementedError


class DynamicNTKRope(_LengthDependentRope):
    """Dynamic NTK scaling: past ``max_position_embeddings`` tokens the base is
    ``theta * (factor * length / max - (factor - 1))^(dim / (dim - 2))``."""

    def frequencies(self, params: dict[str, Any], max_positions: int) -> torch.Tensor:
        if max_positions <= 0:
            raise ValueError("rope type 'dynamic' needs max_position_embeddings in the config")
        self.factor = float(_required(params, "factor"))
        self.threshold = max_positions
        return self.base_frequencies()

    def cache_salt(self, prompt_len: int) -> str | None:
        return f"rope-length:{prompt_len}" if prompt_len > self.threshold else None

    def frequencies_at(self, lengths: torch.Tensor) -> torch.Tensor:
        # Each token's base, computed in float64 and rounded once (as transformers' Python float),
        # then raised in float32; lengths up to the threshold keep theta.
        dim = self.rotary_dim
        stretched = lengths.clamp(min=self.threshold).double() * (self.factor / self.threshold) - (self.factor - 1)
        bases = (self.theta * stretched ** (dim / (dim - 2))).float()
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=lengths.device).float() / dim
        return 1.0 / (bases.unsqueeze(-1) ** exponents.unsqueeze(0))


class LongRope(_LengthDependentRope):
    """Phi-3's LongRoPE: frequencies divided per dimension by ``short_factor`` up to
    ``original_max_position_embeddings`` tokens, by ``long_factor`` past it; cos/sin scaled by
    ``sqrt(1 + ln(factor) / ln(original))`` unless an attention factor is given."""

    long_inv_freq: torch.Tensor

    def frequencies(self, params: dict[str, Any], max_positions: int) -> torch.Tensor:
        original = int(_required(params, "original_max_position_embeddings"))
        self.threshold = original
        factor = params.get("factor")
        factor = float(factor) if factor is not None else max_positions / original
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        self.attention_factor = float(attention_factor)
        shape = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim

        def scaled(key: str) -> torch.Tensor:
            factors = torch.tensor(_required(params, key), dtype=torch.float32)
            if factors.shape != shape.shape:
                raise ValueError(f"rope {key} has {len(factors)} values, the rotary dimension needs {len(shape)}")
            return 1.0 / (factors * self.theta**shape)

        self.register_buffer("long_inv_freq", scaled("long_factor"), persistent=False)
        return scaled("short_factor")

    def cache_salt(self, prompt_len: int) -> str | None:
        return "rope-long" if prompt_len > self.threshold else None

    def frequencies_at(self, lengths: torch.Tensor) -> torch.Tensor:
        long = (lengths > self.threshold).unsqueeze(-1)
        return torch.where(long, self.long_inv_freq.unsqueeze(0), self.inv_freq.unsqueeze(0))


def rope_lengths(positions: np.ndarray, query_start_loc: np.ndarray, prompt_lens: np.ndarray) -> np.ndarray:
    """Each token's length for the length-dependent variants: ``max(prompt length,
    position + 1)`` (see the module's note). ``int64 [num_tokens]``"""
    per_seq = np.diff(query_start_loc) if len(query_start_loc) else np.zeros(0, np.int64)
    return np.maximum(np.repeat(prompt_lens.astype(np.int64), per_seq), positions + 1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: ``[num_tokens, num_heads, head_dim]``; cos/sin: ``[num_tokens, rotary_dim]``
    (the first ``rotary_dim`` features of each head rotate, the rest pass through)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = _rotate(x[..., :rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    return _rotate(x, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
