"""The decoder every registered family runs on (`pagedrs.models.registry`): Llama's block,
switched by the family's settings and the Hugging Face config (Mistral, Qwen2/3, Gemma 1/2/3,
Phi-3, Granite, OLMo 2; mixtures of experts; DeepSeek's latent attention, `pagedrs.models.mla`).

Each layer has its own attention spec (`LayerAttention`: window, softcap, scale, rotary), so
models that mix sliding and global layers (Gemma 2/3, Qwen2/3 ``use_sliding_window``) run
each layer with its own; the step's attention metadata is built once per attention view (a
layer group's blocks under one window, `pagedrs.engine.kv_layout`) and every layer reads its
view's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedrs.attention import AttentionMetadata, StepViews
from pagedrs.checkpoint import ROPE_FACTORS, RowSlice, WeightHandle, expert_of
from pagedrs.layers import fused
from pagedrs.layers.linear import ColumnParallelLinear, RowParallelLinear, TensorParallel, VocabEmbedding
from pagedrs.layers.moe import Activation, Routing, SparseMoe
from pagedrs.layers.norm import RMSNorm
from pagedrs.layers.rotary import RotaryEmbedding, apply_rotary, get_rope, per_layer_type
from pagedrs.models.mla import LatentAttention, latent_scale, latent_width
from pagedrs.models.registry import Family, MixtureOfExperts, family_of, is_sequence_classifier
from pagedrs.quant.mxfp4 import Mxfp4Joiner

if TYPE_CHECKING:
    from pagedrs.attention.cpu_backend import CpuAttentionMetadata
    from pagedrs.lora.slots import LoRAHook
    from pagedrs.models.cpu_stack import CpuDecoderStack

    StepCpuAttention = CpuAttentionMetadata | StepViews[CpuAttentionMetadata]

StepAttention = AttentionMetadata | StepViews[AttentionMetadata]
"""A step's attention metadata: one for every layer, or one per attention view."""

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends."""

    window: int | None
    """Keys a query sees, its own included (``None``: all of them)."""
    softcap: float | None
    """Scores become ``softcap * tanh(score / softcap)`` (Gemma 2)."""
    scale: float
    rope: str
    """Its rotary embedding: a key of `DecoderForCausalLM.ropes`."""


def layer_attention(config: Any, family: Family, head_dim: int) -> list[LayerAttention]:
    """Each layer's attention spec, from the config; ``ValueError`` for what pagedrs does not
    implement (bidirectional attention, unknown layer types)."""
    num_layers = config.num_hidden_layers
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")
    window = getattr(config, "sliding_window", None)
    layer_types = list(getattr(config, "layer_types", None) or [])
    if family.window_on_every_layer:
        layer_types = ["sliding_attention" if window is not None else "full_attention"] * num_layers
    elif not layer_types:
        layer_types = ["full_attention"] * num_layers
    if len(layer_types) != num_layers or any(kind not in _LAYER_TYPES for kind in layer_types):
        raise ValueError(f"layer_types must name {num_layers} layers among {_LAYER_TYPES}, got {layer_types!r}")
    if "sliding_attention" in layer_types and (window is None or int(window) <= 0):
        raise ValueError(f"sliding-attention layers need a positive sliding_window, got {window!r}")
    window = int(window) if window is not None else None
    if family.granite_multipliers:
        scale = float(config.attention_multiplier)
    elif family.query_pre_attn_scalar:
        scale = float(config.query_pre_attn_scalar) ** -0.5
    elif family.latent_attention:
        scale = latent_scale(config)
    else:
        scale = head_dim**-0.5
    softcap = getattr(config, "attn_logit_softcapping", None)
    per_type = per_layer_type(config)
    return [
        LayerAttention(
            window=window if kind == "sliding_attention" else None,
            softcap=float(softcap) if softcap else None,
            scale=scale,
            rope=kind if per_type else "default",
        )
        for kind in layer_types
    ]


def _norm(config: Any, family: Family, size: int, dtype: torch.dtype) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, dtype, style=family.norm)


class Attention(nn.Module):
    def __init__(self, config: Any, family: Family, spec: LayerAttention, tp: TensorParallel, dtype: torch.dtype):
        super().__init__()
        # Qwen2 has q/k/v biases whatever the config says; `attention_bias` (Llama, Mistral,
        # Qwen3, Gemma, Granite, OLMo 2) puts biases on q/k/v and on the output projection.
        output_bias = bool(getattr(config, "attention_bias", False))
        bias = family.qkv_bias or output_bias or bool(family.qkv_bias_key and getattr(config, family.qkv_bias_key))
        self.spec = spec
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = tp.split(config.num_attention_heads, "num_attention_heads")
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        # NOTE: with fewer KV heads than ranks, each rank holds one KV head (a copy of it on
        # `kv_replicas` ranks), serving the query heads that share it.
        kv_replicas = tp.replicas(num_kv_heads, "num_key_value_heads")
        self.num_kv_heads = num_kv_heads * kv_replicas // tp.size
        q_size, kv_size = config.num_attention_heads * self.head_dim, num_kv_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, [q_size, kv_size, kv_size], bias, tp, dtype, replicas=[1, kv_replicas, kv_replicas]
        )
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, output_bias, tp, dtype)
        self.full_qk_norm = family.qk_norm == "full"
        if self.full_qk_norm and tp.size > 1:
            # NOTE: a norm over every head's features would need an all-reduce across ranks.
            raise ValueError("q/k norms over all heads (OLMo 2) do not run with tensor parallelism yet")
        q_norm_size = q_size if self.full_qk_norm else self.head_dim
        k_norm_size = kv_size if self.full_qk_norm else self.head_dim
        self.q_norm = _norm(config, family, q_norm_size, dtype) if family.qk_norm else None
        self.k_norm = _norm(config, family, k_norm_size, dtype) if family.qk_norm else None
        # gpt-oss: a logit per query head in its softmax; each rank holds its heads'.
        self.heads = slice(tp.rank * self.num_heads, (tp.rank + 1) * self.num_heads)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=dtype), False) if family.attention_sinks else None
        self.lora: LoRAHook | None = None
        """Adds the step's LoRA updates to ``qkv_proj`` and ``o_proj`` (`pagedrs.lora`)."""

    @property
    def scale(self) -> float:
        return self.spec.scale

    def forward(self, hidden, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(hidden)
        if self.lora is not None:
            qkv = self.lora("qkv_proj", hidden, qkv)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        # OLMo 2 normalizes q and k over all heads at once, Qwen3 and Gemma 3 head by head.
        norms = (self.q_norm, self.k_norm) if self.q_norm is not None and self.k_norm is not None else None
        if norms is not None and self.full_qk_norm:
            q, k = norms[0](q), norms[1](k)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if norms is not None and not self.full_qk_norm:
            q, k = norms[0](q), norms[1](k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = meta.attend(
            q, k, v, kv_cache[0], kv_cache[1], self.spec.scale, softcap=self.spec.softcap, sinks=self.sinks
        )
        out = out.reshape(-1, q_size)
        if self.lora is not None:
            return self.lora("o_proj", out, self.o_proj(out))
        return self.o_proj(out)


def _activation(config: Any, family: Family) -> str:
    activation = getattr(config, family.activation_key, None) or "silu"
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not supported ({', '.join(_ACTIVATIONS)})")
    return activation


class MLP(nn.Module):
    def __init__(
        self, config: Any, family: Family, tp: TensorParallel, dtype: torch.dtype, intermediate: int | None = None
    ):
        """``intermediate``: the width (default: the config's ``intermediate_size``)."""
        super().__init__()
        self.activation = _activation(config, family)
        self._act = _ACTIVATIONS[self.activation]
        intermediate = intermediate or config.intermediate_size
        self.intermediate_size = tp.split(intermediate, "intermediate_size")
        """This rank's width of the intermediate features."""
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [intermediate, intermediate], bias, tp, dtype)
        self.down_proj = RowParallelLinear(intermediate, config.hidden_size, bias, tp, dtype)
        self.lora: LoRAHook | None = None
        """Adds the step's LoRA updates to ``gate_up_proj`` and ``down_proj`` (`pagedrs.lora`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.lora is not None:
            gate_up = self.lora("gate_up_proj", x, gate_up)
        if self.activation == "silu" and fused.enabled(gate_up):
            h = fused.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = self._act(gate) * up
        if self.lora is not None:
            return self.lora("down_proj", h, self.down_proj(h))
        return self.down_proj(h)


def is_sparse_layer(config: Any, family: Family, index: int) -> bool:
    """Whether layer ``index`` of a mixture-of-experts family is a mixture (else a dense MLP)."""
    if family.moe is None:
        return False
    if family.moe.deepseek:
        return index >= int(getattr(config, "first_k_dense_replace", 0) or 0)
    if not family.moe.sparse_step:
        return True
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return index not in dense and int(getattr(config, family.moe.num_experts_key)) > 0 and (index + 1) % step == 0


def sparse_moe(config: Any, family: Family, tp: TensorParallel, dtype: torch.dtype) -> SparseMoe:
    """A mixture-of-experts MLP as ``config`` describes it; ``ValueError`` for settings pagedrs
    does not run."""
    moe = cast(MixtureOfExperts, family.moe)
    if getattr(config, "clip_qkv", None) is not None:
        raise ValueError("clip_qkv is not supported")
    renormalize = moe.always_renormalize or bool(getattr(config, "norm_topk_prob", False))
    num_experts, top_k = int(getattr(config, moe.num_experts_key)), int(config.num_experts_per_tok)
    routing = Routing(num_experts, top_k, renormalize, softmax_after_topk=moe.gpt_oss)
    width = int(getattr(config, moe.width_key))
    shared = None
    if moe.deepseek:
        routing = deepseek_routing(config, moe.deepseek, num_experts, top_k)
        num_shared = int(getattr(config, "n_shared_experts", 0) or 0)
        if num_shared > 0:  # one MLP as wide as all of them
            shared = MLP(config, family, tp, dtype, intermediate=num_shared * width)
    elif moe.shared_expert and int(getattr(config, "shared_expert_intermediate_size", 0) or 0) > 0:
        shared = MLP(config, family, tp, dtype, intermediate=int(config.shared_expert_intermediate_size))
    activation = Activation(_activation(config, family))
    if moe.gpt_oss:
        activation = Activation("swiglu_oai", float(config.swiglu_alpha), float(config.swiglu_limit))
    return SparseMoe(
        routing,
        config.hidden_size,
        width,
        activation,
        tp,
        dtype,
        shared,
        bias=moe.gpt_oss,
        shared_gate=moe.deepseek is None,
        score_bias=moe.deepseek == "v3",
    )


def deepseek_routing(config: Any, version: str, num_experts: int, top_k: int) -> Routing:
    """DeepSeek-V2's or V3's router as transformers runs it; ``ValueError`` for the settings
    of DeepSeek's own code that transformers does not follow (so pagedrs cannot be checked
    against it)."""
    if int(getattr(config, "moe_layer_freq", 1) or 1) != 1:
        raise ValueError("moe_layer_freq other than 1 is not supported (transformers ignores it)")
    groups = int(getattr(config, "n_group", None) or 1)
    topk_groups = int(getattr(config, "topk_group", None) or groups)
    scale = float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)
    scoring = getattr(config, "scoring_func", None) or ("softmax" if version == "v2" else "sigmoid")
    method = getattr(config, "topk_method", None) or ("greedy" if version == "v2" else "noaux_tc")
    if version == "v2":
        if scoring != "softmax" or method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2 routing {scoring}/{method} is not supported (softmax, greedy or grouped)")
        if getattr(config, "norm_topk_prob", False):
            # DeepSeek's code renormalizes, transformers does not: no oracle to match.
            raise ValueError("norm_topk_prob is not supported for DeepSeek-V2 (transformers ignores it)")
        if method == "greedy":
            groups = topk_groups = 1
        return Routing(num_experts, top_k, False, num_groups=groups, topk_groups=topk_groups, scale=scale)
    if scoring != "sigmoid" or method != "noaux_tc":
        raise ValueError(f"DeepSeek-V3 routing {scoring}/{method} is not supported (sigmoid, noaux_tc)")
    renormalize = bool(getattr(config, "norm_topk_prob", False))
    return Routing(
        num_experts,
        top_k,
        renormalize,
        scoring="sigmoid",
        num_groups=groups,
        topk_groups=topk_groups,
        group_score="top2_sum",
        scale=scale,
    )


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        family: Family,
        spec: LayerAttention,
        tp: TensorParallel,
        dtype: torch.dtype,
        sparse: bool = False,
    ):
        """``sparse``: the MLP is a mixture of experts."""
        super().__init__()
        size = config.hidden_size
        self.placement = family.norm_placement
        self.input_layernorm = _norm(config, family, size, dtype) if self.placement != "post" else None
        self.self_attn: Attention | LatentAttention = (
            LatentAttention(config, spec.scale, tp, dtype)
            if family.latent_attention
            else Attention(config, family, spec, tp, dtype)
        )
        # "pre": the norm before the MLP (Hugging Face's name for it); else the one after attention.
        self.post_attention_layernorm = _norm(config, family, size, dtype)
        sandwich = self.placement == "sandwich"
        self.pre_feedforward_layernorm = _norm(config, family, size, dtype) if sandwich else None
        self.post_feedforward_layernorm = _norm(config, family, size, dtype) if self.placement != "pre" else None
        self.mlp: MLP | SparseMoe = sparse_moe(config, family, tp, dtype) if sparse else MLP(config, family, tp, dtype)
        self.residual_multiplier = float(config.residual_multiplier) if family.granite_multipliers else 1.0

    def norms(self) -> dict[str, RMSNorm | None]:
        """The layer's norms by checkpoint name."""
        norms = {
            "input_layernorm": self.input_layernorm,
            "post_attention_layernorm": self.post_attention_layernorm,
            "pre_feedforward_layernorm": self.pre_feedforward_layernorm,
            "post_feedforward_layernorm": self.post_feedforward_layernorm,
        }
        attn = self.self_attn
        if isinstance(attn, Attention):
            norms.update({"self_attn.q_norm": attn.q_norm, "self_attn.k_norm": attn.k_norm})
        return norms

    def _residual(self, x: torch.Tensor) -> torch.Tensor:
        """A branch's output as it joins the residual stream (Granite scales it)."""
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier

    def forward(self, hidden, cos, sin, kv_cache, meta):
        if self.placement == "pre":
            attended = self.self_attn(cast(RMSNorm, self.input_layernorm)(hidden), cos, sin, kv_cache, meta)
            norm = self.post_attention_layernorm
            if self.residual_multiplier == 1.0 and norm.plain and fused.enabled(hidden):
                # the residual add and the norm after it in one kernel (GPU)
                hidden, normed = fused.add_rms_norm(hidden, attended, norm.weight, norm.eps)
                return hidden + self.mlp(normed)
            hidden = hidden + self._residual(attended)
            return hidden + self._residual(self.mlp(norm(hidden)))
        normed = hidden if self.input_layernorm is None else self.input_layernorm(hidden)
        hidden = hidden + self.post_attention_layernorm(self.self_attn(normed, cos, sin, kv_cache, meta))
        normed = hidden if self.pre_feedforward_layernorm is None else self.pre_feedforward_layernorm(hidden)
        return hidden + cast(RMSNorm, self.post_feedforward_layernorm)(self.mlp(normed))


class DecoderForCausalLM(nn.Module):
    """A decoder-only model of a registered family for a flat batch of tokens."""

    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel):
        super().__init__()
        self.config = config
        self.family = family = family_of(config)
        self.tp = tp
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if family.latent_attention:
            head_dim = int(config.qk_rope_head_dim)  # what rotates: each head's rotary part
        specs = layer_attention(config, family, head_dim)
        # Every rotary embedding first (a bad rotary config fails before any layer is built).
        self.ropes = nn.ModuleDict(
            {
                key: get_rope(config, head_dim, None if key == "default" else key)
                for key in dict.fromkeys(spec.rope for spec in specs)
            }
        )
        partial = [key for key, rope in self.ropes.items() if cast(RotaryEmbedding, rope).rotary_dim != head_dim]
        if partial and not family.partial_rotary:
            # transformers' other families ignore partial_rotary_factor or fail on it.
            raise ValueError(f"partial_rotary_factor is not supported for {type(config).__name__} models")
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        layers = [
            DecoderLayer(config, family, spec, tp, dtype, sparse=is_sparse_layer(config, family, index))
            for index, spec in enumerate(specs)
        ]
        self.layers = nn.ModuleList(layers)
        self.norm = _norm(config, family, config.hidden_size, dtype)
        self.sequence_classifier = is_sequence_classifier(config)
        """A ``*ForSequenceClassification`` checkpoint: a classifier head (``score``), no
        language-model head; it pools, it does not generate."""
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = (
            None
            if self.tie_word_embeddings or self.sequence_classifier
            else VocabEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        )
        self.score: nn.Linear | None = None
        """The classifier head (``[num_labels, hidden]``, replicated on every rank): a sequence
        classifier's ``score``, or rows of the language-model head (`use_token_classifier`)."""
        if self.sequence_classifier:
            self.score = nn.Linear(config.hidden_size, int(config.num_labels), bias=False, dtype=dtype)
            self.score.weight.requires_grad_(False)
        attn = layers[0].self_attn
        self.num_heads = attn.num_heads
        self.latent_cache = isinstance(attn, LatentAttention)
        """The cache holds one latent per token (`pagedrs.models.mla`): one "head" of
        `latent_width` features, the key cache and the value cache one tensor."""
        if isinstance(attn, LatentAttention):
            self.num_kv_heads, self.head_dim = 1, latent_width(config)
        else:
            self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.layer_specs = specs
        self.layer_windows: tuple[int | None, ...] = tuple(spec.window for spec in specs)
        """Each layer's window (``None``: full attention): what `KVLayout.plan` groups by."""
        self.softcap = any(spec.softcap for spec in specs)
        self.attention_sinks = family.attention_sinks
        self.embedding_scale = 1.0
        if family.embedding_scale == "sqrt_hidden":
            self.embedding_scale = math.sqrt(config.hidden_size)
        elif family.embedding_scale == "multiplier":
            self.embedding_scale = float(config.embedding_multiplier)
        self.logits_scaling = float(config.logits_scaling) if family.granite_multipliers else 1.0
        final_softcap = getattr(config, "final_logit_softcapping", None)
        self.final_logit_softcap = float(final_softcap) if final_softcap else None

    @property
    def rotary(self) -> RotaryEmbedding:
        """The rotary embedding of the first layer (the only one, for most families)."""
        return cast(RotaryEmbedding, self.ropes[self.layer_specs[0].rope])

    @property
    def length_dependent_rope(self) -> bool:
        """Whether any rotary embedding follows the sequence's length (`rope_lengths`)."""
        return any(cast(RotaryEmbedding, rope).length_dependent for rope in self.ropes.values())

    def cache_salt(self, prompt_len: int) -> str | None:
        """What a request's prefix-cache salt must carry for its keys to be shared exactly
        (`RotaryEmbedding.cache_salt`)."""
        salts = [cast(RotaryEmbedding, rope).cache_salt(prompt_len) for rope in self.ropes.values()]
        return "|".join(salt for salt in salts if salt) or None

    def decoder_layers(self) -> list[DecoderLayer]:
        """The decoder layers, typed."""
        return cast(list[DecoderLayer], list(self.layers))  # ModuleList's stubs lose the element type

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: StepAttention,
        logits_indices: torch.Tensor,
        decoder_stack: CpuDecoderStack | None = None,
        rope_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs the step's tokens; returns float32 logits of the ``logits_indices`` rows.
        ``meta``: one metadata for every layer, or one per attention view; ``decoder_stack``: the
        layers as one compiled call on the CPU, when the runner picked that strategy
        (`pagedrs.models.cpu_stack`); ``None``: the Python layers. ``rope_lengths``: each
        token's length for length-dependent rotary embeddings (`pagedrs.layers.rotary`)."""
        if decoder_stack is not None and decoder_stack.has_head:  # the head in the stack's call
            logits = self.final_hidden(
                input_ids, positions, kv_caches, meta, logits_indices, decoder_stack, rope_lengths, head=True
            )
            return self._finish_logits(logits)
        hidden = self.final_hidden(input_ids, positions, kv_caches, meta, logits_indices, decoder_stack, rope_lengths)
        return self.compute_logits(hidden)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' rows of the embedding table, scaled where the family scales them."""
        hidden = self.embed_tokens(input_ids)
        if self.embedding_scale != 1.0:
            # As transformers: the scale in the model's dtype (Gemma's normalizer).
            hidden = hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype)
        return hidden

    def final_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: StepAttention,
        rows: torch.Tensor,
        decoder_stack: CpuDecoderStack | None = None,
        rope_lengths: torch.Tensor | None = None,
        *,
        head: bool = False,
    ) -> torch.Tensor:
        """Runs the step's tokens (as `forward`); returns the last layer's hidden states of the
        ``rows`` tokens after the final norm, in the model's dtype (what the head reads, and
        what pooling requests pool). ``head``: the head's logits of those rows instead (before
        `_finish_logits`), from the stack's call (only where `CpuDecoderStack.has_head`)."""
        if decoder_stack is not None and (tables := decoder_stack.rope_tables(positions)) is not None:
            # NOTE: the stack overwrites `hidden` in place (see below); where it `embeds`, it takes
            # the token ids and looks them up in the embedding table itself.
            hidden = input_ids if decoder_stack.embeds else self._embed(input_ids)
            return decoder_stack(hidden, tables, kv_caches, cast("StepCpuAttention", meta), rows, positions, head)
        hidden = self._embed(input_ids)
        cos_sin = {
            key: cast(RotaryEmbedding, rope).cos_sin(positions, hidden.dtype, rope_lengths)
            for key, rope in self.ropes.items()
        }
        if decoder_stack is not None:
            # NOTE: the stack overwrites `hidden` in place; the embedding lookups return a new
            # tensor (never a view of the weights), so nothing else sees it change.
            return decoder_stack(
                hidden, list(cos_sin.values()), kv_caches, cast("StepCpuAttention", meta), rows, None, head
            )
        if head:
            raise ValueError("the head's logits come with the layers from the CPU stack's call only")
        for index, (layer, spec, kv_cache) in enumerate(zip(self.decoder_layers(), self.layer_specs, kv_caches)):
            layer_meta = meta.of_layer(index) if isinstance(meta, StepViews) else meta
            cos, sin = cos_sin[spec.rope]
            hidden = layer(hidden, cos, sin, kv_cache, layer_meta)
        return self.norm(hidden[rows])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of final hidden states (`final_hidden`)."""
        if self.sequence_classifier:
            raise ValueError("this model is a sequence classifier: it has no language-model head and cannot generate")
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return self._finish_logits(head.logits(hidden))

    def _finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's output as the model's float32 logits (its scaling and softcap)."""
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        logits = logits if logits.dtype == torch.float32 else logits.float()
        if self.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the classifier head (``[..., num_labels]``) for pooled hidden
        states (``[..., hidden]``, any float dtype, on the model's device)."""
        if self.score is None:
            raise ValueError(
                "this model has no classifier head: load a *ForSequenceClassification checkpoint "
                "(or a causal model with hf_overrides classifier_from_token, docs/pooling.md)"
            )
        weight = self.score.weight
        return (pooled.to(weight.dtype) @ weight.T).float()

    def use_token_classifier(self, token_ids: list[int], difference: bool) -> None:
        """Makes the language-model head's rows of ``token_ids`` the classifier (vLLM's
        ``classifier_from_token``): one label per token, or with ``difference`` (two tokens,
        Qwen3-Reranker's "no"/"yes") one label, the second row minus the first, whose sigmoid
        is the softmax probability of the second token over the two."""
        from pagedrs.quant.layers import QuantVocabEmbedding

        head = self.embed_tokens if self.lm_head is None else self.lm_head
        weight = getattr(head, "weight", None)
        if self.tp.size > 1 or not isinstance(weight, torch.Tensor) or weight.shape[0] < self.config.vocab_size:
            raise ValueError(
                "classifier_from_token needs the whole language-model head on one rank (no tensor parallelism)"
            )
        if self.final_logit_softcap is not None:  # tanh is not linear: the rows are not the logits' rows
            raise ValueError("classifier_from_token does not take a model whose logits are soft-capped")
        ids = torch.tensor(token_ids, device=weight.device)
        # A packed GGUF head's rows are blocks of bytes: its lookup gives the values it multiplies by.
        rows = head._lookup(ids) if isinstance(head, QuantVocabEmbedding) else weight[ids]
        # In float32: a difference of two bf16 rows would round; Granite's scaling divides the logits.
        rows = rows.detach().float() / self.logits_scaling
        rows = (rows[1:2] - rows[0:1]) if difference else rows
        self.score = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=torch.float32)
        self.score.weight.requires_grad_(False).copy_(rows)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, WeightHandle]]) -> None:
        """Loads Hugging Face checkpoint tensors (lazy handles of the full tensors), each into
        this rank's shard, reading only that shard. Fails on a missing or unexpected tensor."""
        loaded: set[str] = set()
        expected = {name for name, _ in self.named_parameters()}
        if self.family.moe is not None and self.family.moe.gpt_oss:
            weights = Mxfp4Joiner()(weights)  # gpt-oss's MXFP4 experts, dequantized
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            for part_name, part in self._split_fused(name, tensor):
                loaded.update(self._load_one(part_name, part))
        if self.tie_word_embeddings:
            loaded.add("lm_head.weight")
        missing = {name for name in expected if name not in loaded}
        for index, layer in enumerate(self.decoder_layers()):
            if isinstance(layer.mlp, SparseMoe):
                missing.update(f"layers.{index}.mlp.experts.{part}" for part in layer.mlp.experts.unloaded())
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _split_fused(self, name: str, tensor: WeightHandle) -> list[tuple[str, WeightHandle]]:
        """A fused checkpoint tensor (Phi-3's ``qkv_proj`` / ``gate_up_proj``) as its parts,
        row ranges read lazily; any other tensor as it is."""
        if not self.family.fused_checkpoint:
            return [(name, tensor)]
        config = self.config
        if ".self_attn.qkv_proj." in name:
            q_size = config.num_attention_heads * self.head_dim
            kv_size = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * self.head_dim
            bounds = [("q_proj", 0, q_size), ("k_proj", q_size, kv_size), ("v_proj", q_size + kv_size, kv_size)]
            return [(name.replace("qkv_proj", part), RowSlice(tensor, start, size)) for part, start, size in bounds]
        if ".mlp.gate_up_proj." in name:
            size = config.intermediate_size
            return [
                (name.replace("gate_up_proj", "gate_proj"), RowSlice(tensor, 0, size)),
                (name.replace("gate_up_proj", "up_proj"), RowSlice(tensor, size, size)),
            ]
        return [(name, tensor)]

    def _load_rope_factors(self, tensor: WeightHandle) -> None:
        """Llama 3's rotary scaling as a GGUF file stores it (``rope_freqs``: each frequency's
        divisor, llama.cpp's form of the ``llama3`` rule): the plain frequencies divided."""
        factors = tensor[:].float().reshape(-1)
        for key, module in self.ropes.items():
            rope = cast(RotaryEmbedding, module)
            if type(rope) is not RotaryEmbedding:
                raise ValueError(f"a GGUF rope_freqs tensor on top of a {type(rope).__name__} ({key}) rotary")
            if factors.shape != rope.inv_freq.shape:
                raise ValueError(f"rope_freqs has {len(factors)} values, the rotary needs {len(rope.inv_freq)}")
            if not bool(torch.isfinite(factors).all()) or bool((factors <= 0).any()):
                raise ValueError("rope_freqs holds a non-positive or non-finite factor")
            rope.inv_freq.copy_(rope.base_frequencies().to(rope.inv_freq.device) / factors.to(rope.inv_freq.device))

    def _load_one(self, name: str, tensor: WeightHandle) -> list[str]:
        if name == ROPE_FACTORS:
            self._load_rope_factors(tensor)
            return []
        name = name.removeprefix("model.")
        if name == "embed_tokens.weight":
            self.embed_tokens.load(tensor)
            return ["embed_tokens.weight"]
        if name == "lm_head.weight":
            if self.lm_head is None:
                return []  # tied: the embedding serves as the head
            self.lm_head.load(tensor)
            return ["lm_head.weight"]
        if name == "norm.weight":
            self.norm.load(tensor)
            return ["norm.weight"]
        if name == "score.weight" and self.sequence_classifier and self.score is not None:
            if tuple(tensor.shape) != tuple(self.score.weight.shape):
                raise ValueError(f"score.weight has shape {tuple(tensor.shape)}, not {tuple(self.score.weight.shape)}")
            self.score.weight.copy_(tensor[:])
            return ["score.weight"]
        parts = name.split(".")
        if parts[0] != "layers":
            raise ValueError(f"unexpected checkpoint tensor {name!r}")
        layer = self.decoder_layers()[int(parts[1])]
        prefix = f"layers.{parts[1]}."
        rest, kind = ".".join(parts[2:-1]), parts[-1]
        attn, mlp = layer.self_attn, layer.mlp
        if isinstance(mlp, SparseMoe) and rest.split(".")[0] in ("mlp", "block_sparse_moe"):
            return [prefix + loaded for loaded in _load_moe(mlp, rest, kind, tensor)]
        if isinstance(attn, LatentAttention) and parts[2] == "self_attn":
            latent = attn.load(".".join(parts[3:-1]), kind, tensor)
            if latent is None:
                raise ValueError(f"unexpected checkpoint tensor {name!r}")
            return [prefix + latent]
        fused_parts: dict[str, tuple[ColumnParallelLinear, int, str]] = {}
        if isinstance(attn, Attention):
            fused_parts["self_attn.q_proj"] = (attn.qkv_proj, 0, "self_attn.qkv_proj")
            fused_parts["self_attn.k_proj"] = (attn.qkv_proj, 1, "self_attn.qkv_proj")
            fused_parts["self_attn.v_proj"] = (attn.qkv_proj, 2, "self_attn.qkv_proj")
        if isinstance(mlp, MLP):
            fused_parts["mlp.gate_proj"] = (mlp.gate_up_proj, 0, "mlp.gate_up_proj")
            fused_parts["mlp.up_proj"] = (mlp.gate_up_proj, 1, "mlp.gate_up_proj")
        if rest in fused_parts:
            module, shard, target = fused_parts[rest]
            (module.load if kind == "weight" else module.load_bias)(shard, tensor)
            return [f"{prefix}{target}.{kind}"]
        if rest == "self_attn.o_proj" or (rest == "mlp.down_proj" and isinstance(mlp, MLP)):
            projection = attn.o_proj if rest == "self_attn.o_proj" else cast(MLP, mlp).down_proj
            (projection.load if kind == "weight" else projection.load_bias)(tensor)
            return [f"{prefix}{rest}.{kind}"]
        if rest == "self_attn" and kind == "sinks" and isinstance(attn, Attention) and attn.sinks is not None:
            attn.sinks.copy_(tensor[attn.heads])
            return [f"{prefix}self_attn.sinks"]
        norm = layer.norms().get(rest)
        if norm is not None and kind == "weight":
            norm.load(tensor)
            return [f"{prefix}{rest}.weight"]
        raise ValueError(f"unexpected checkpoint tensor {name!r}")


# Mixtral's names of an expert's projections (``block_sparse_moe.experts.N.w1``) -> the others'.
_MIXTRAL_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _load_moe(moe: SparseMoe, rest: str, kind: str, tensor: WeightHandle) -> list[str]:
    """Loads a mixture's checkpoint tensor (``rest``: its name after ``layers.N.``, without the
    last part, ``kind``) in any of the layouts checkpoints store experts in: one tensor per
    expert and projection (``mlp.experts.3.gate_proj.weight``; Mixtral's
    ``block_sparse_moe.experts.3.w1.weight``), transformers' stacked ``mlp.experts.gate_up_proj``
    ``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``, or one stacked tensor per
    projection (``mlp.experts.gate_proj.weight`` ``[E, I, H]``, as GGUF's ``ffn_gate_exps``).
    Returns the parameter names loaded (relative to the layer)."""
    parts = rest.split(".")
    parts[0] = "mlp"  # Mixtral's block_sparse_moe
    experts = moe.experts
    if moe.gate_bias is not None:  # gpt-oss
        return _load_gpt_oss(moe, parts, kind, tensor)
    if len(parts) == 4 and parts[1] == "experts" and kind == "weight":  # one expert's projection
        expert, projection = int(parts[2]), _MIXTRAL_EXPERT_NAMES.get(parts[3], parts[3])
        if projection in ("gate_proj", "up_proj"):
            experts.load_gate_up(expert, 0 if projection == "gate_proj" else 1, tensor)
            return ["mlp.experts.gate_up"]
        if projection == "down_proj":
            experts.load_down(expert, tensor)
            return ["mlp.experts.down"]
    stacked = parts[1:] == ["experts"] and kind in ("gate_up_proj", "down_proj")  # transformers' names
    stacked = stacked or (len(parts) == 3 and parts[1] == "experts" and kind == "weight")
    if stacked:
        projection = kind if kind != "weight" else parts[2]
        if projection not in ("gate_up_proj", "gate_proj", "up_proj", "down_proj"):
            raise ValueError(f"unexpected experts tensor {rest}.{kind}")
        if len(tensor.shape) != 3 or tensor.shape[0] != experts.num_experts:
            raise ValueError(f"{rest}.{kind} must stack {experts.num_experts} experts, got shape {tuple(tensor.shape)}")
        for expert in range(experts.num_experts):
            weight = expert_of(tensor, expert)
            if projection == "gate_up_proj":
                size = weight.shape[0] // 2
                experts.load_gate_up(expert, 0, RowSlice(weight, 0, size))
                experts.load_gate_up(expert, 1, RowSlice(weight, size, size))
            elif projection == "down_proj":
                experts.load_down(expert, weight)
            else:
                experts.load_gate_up(expert, 0 if projection == "gate_proj" else 1, weight)
        return ["mlp.experts.down" if projection == "down_proj" else "mlp.experts.gate_up"]
    if parts == ["mlp", "gate"] and kind == "weight":  # the router
        moe.gate.copy_(tensor[:])
        return ["mlp.gate"]
    if parts == ["mlp", "shared_expert_gate"] and kind == "weight" and moe.shared_expert_gate is not None:
        moe.shared_expert_gate.copy_(tensor[:])
        return ["mlp.shared_expert_gate"]
    if parts == ["mlp", "gate"] and kind == "e_score_correction_bias" and moe.score_bias is not None:
        moe.score_bias.copy_(tensor[:])
        return ["mlp.score_bias"]
    shared = moe.shared_expert
    # Qwen2-MoE's shared_expert, DeepSeek's shared_experts (one MLP as wide as all of them).
    shared_names = ("shared_expert", "shared_experts")
    if len(parts) == 3 and parts[1] in shared_names and kind == "weight" and isinstance(shared, MLP):
        if parts[2] in ("gate_proj", "up_proj"):
            shared.gate_up_proj.load(0 if parts[2] == "gate_proj" else 1, tensor)
            return ["mlp.shared_expert.gate_up_proj.weight"]
        if parts[2] == "down_proj":
            shared.down_proj.load(tensor)
            return ["mlp.shared_expert.down_proj.weight"]
    raise ValueError(f"unexpected checkpoint tensor {rest}.{kind} of a mixture-of-experts layer")


def _load_gpt_oss(moe: SparseMoe, parts: list[str], kind: str, tensor: WeightHandle) -> list[str]:
    """gpt-oss's mixture tensors: the router (``mlp.router.weight`` / ``.bias``) and the stacked
    experts, stored transposed with gate and up interleaved: ``gate_up_proj [E, H, 2I]`` (gate
    in the even columns, up in the odd), ``gate_up_proj_bias [E, 2I]`` likewise, ``down_proj
    [E, I, H]``, ``down_proj_bias [E, H]``."""
    experts = moe.experts
    if parts == ["mlp", "router"] and kind in ("weight", "bias"):
        (moe.gate if kind == "weight" else cast(torch.Tensor, moe.gate_bias)).copy_(tensor[:])
        return ["mlp.gate" if kind == "weight" else "mlp.gate_bias"]
    stacked = {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}
    if parts != ["mlp", "experts"] or kind not in stacked:
        raise ValueError(f"unexpected checkpoint tensor {'.'.join(parts)}.{kind} of a gpt-oss mixture")
    if tensor.shape[0] != experts.num_experts:
        raise ValueError(f"{kind} must stack {experts.num_experts} experts, got shape {tuple(tensor.shape)}")
    for expert in range(experts.num_experts):
        value = tensor[expert : expert + 1][0]
        if kind == "gate_up_proj":  # [H, 2I] -> gate, up [I, H]
            experts.load_gate_up(expert, 0, value[:, 0::2].t())
            experts.load_gate_up(expert, 1, value[:, 1::2].t())
        elif kind == "gate_up_proj_bias":
            experts.load_gate_up_bias(expert, 0, value[0::2])
            experts.load_gate_up_bias(expert, 1, value[1::2])
        elif kind == "down_proj":  # [I, H] -> [H, I]
            experts.load_down(expert, value.t())
        else:
            experts.load_down_bias(expert, value)
    names = {"gate_up_proj": "gate_up", "gate_up_proj_bias": "gate_up_bias", "down_proj": "down"}
    return [f"mlp.experts.{names.get(kind, 'down_bias')}"]
