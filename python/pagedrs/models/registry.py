"""Which Hugging Face architectures pagedrs runs: one row per architecture, naming the model
class and the family's settings (`Family`). Adding a family whose layers are built from the
shared blocks is a row here (and a row in the tests' table); one whose block structure
differs adds its own model file and names its class in the row.

The settings say how a family differs from Llama; everything a config can say on top
(biases, head size, windows, rotary type, softcaps, multipliers) is read from the config by
the model itself, and a setting the model does not implement is refused at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pagedrs.checkpoint import GGUF_ARCHITECTURES

NormPlacement = Literal["pre", "sandwich", "post"]
NormStyle = Literal["llama", "float32", "gemma"]


@dataclass(frozen=True)
class MixtureOfExperts:
    """How a mixture-of-experts family's config names its experts (`pagedrs.layers.moe`)."""

    num_experts_key: str = "num_experts"
    """The config key of the number of routed experts (Mixtral: ``num_local_experts``)."""
    width_key: str = "moe_intermediate_size"
    """The config key of one expert's intermediate size (Mixtral, OLMoE: ``intermediate_size``)."""
    always_renormalize: bool = False
    """The top-k weights always sum to 1 (Mixtral); else as ``norm_topk_prob`` says."""
    shared_expert: bool = False
    """A shared expert every token runs: Qwen2-MoE's of ``shared_expert_intermediate_size``,
    scaled by a sigmoid gate; DeepSeek's (see ``deepseek``)."""
    sparse_step: bool = False
    """Only layers ``(i + 1) % decoder_sparse_step == 0`` not in ``mlp_only_layers`` are
    mixtures; the others dense MLPs of ``intermediate_size`` (Qwen2-MoE, Qwen3-MoE)."""
    deepseek: Literal["v2", "v3"] | None = None
    """DeepSeek's mixture: experts of ``n_routed_experts``, the first ``first_k_dense_replace``
    layers dense, ``n_shared_experts`` with no gate, scores scaled by ``routed_scaling_factor``;
    V2 routes by softmax (``topk_method`` ``greedy`` or ``group_limited_greedy``), V3 by sigmoid
    with ``e_score_correction_bias`` over the best ``topk_group`` of ``n_group`` groups."""
    gpt_oss: bool = False
    """gpt-oss's mixture: biases on the router (``mlp.router``) and on every expert, the softmax
    over the top-k logits, the clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``), and experts
    stored transposed with gate and up interleaved (``gate_up_proj [E, H, 2I]``)."""


@dataclass(frozen=True)
class Family:
    """How one family's decoder differs from Llama's."""

    qkv_bias: bool = False
    """Biases on q/k/v whatever the config says (Qwen2)."""
    qkv_bias_key: str | None = None
    """The config key saying whether q/k/v have biases (Qwen2-MoE: ``qkv_bias``)."""
    qk_norm: Literal["head", "full"] | None = None
    """RMSNorm of q and k: per head (Qwen3, Gemma 3) or over all heads at once (OLMo 2)."""
    norm: NormStyle = "llama"
    """How RMSNorm applies its weight (`pagedrs.layers.norm.RMSNorm`): ``llama``, ``float32``
    (OLMo 2), ``gemma`` (``1 + weight``)."""
    norm_placement: NormPlacement = "pre"
    """``pre``: a norm before attention and before the MLP (Llama); ``sandwich``: also one on
    each output (Gemma 2/3: ``post_attention``, ``pre_feedforward``, ``post_feedforward``);
    ``post``: only the norms of the outputs (OLMo 2)."""
    embedding_scale: Literal["sqrt_hidden", "multiplier"] | None = None
    """Embeddings times ``sqrt(hidden_size)`` (Gemma) or ``embedding_multiplier`` (Granite)."""
    granite_multipliers: bool = False
    """Granite's ``attention_multiplier`` (the scale), ``residual_multiplier`` and
    ``logits_scaling``."""
    query_pre_attn_scalar: bool = False
    """The attention scale is ``query_pre_attn_scalar ** -0.5`` (Gemma 2/3)."""
    window_on_every_layer: bool = False
    """``sliding_window`` applies to every layer (Mistral, Phi-3) rather than to the layers
    ``layer_types`` names ``sliding_attention`` (Qwen2/3, Gemma 2/3)."""
    fused_checkpoint: bool = False
    """The checkpoint stores ``qkv_proj`` and ``gate_up_proj`` fused (Phi-3)."""
    partial_rotary: bool = False
    """``partial_rotary_factor`` rotates part of each head (Phi-3 / Phi-4-mini); transformers'
    other families here ignore it or fail on it, so pagedrs refuses it for them."""
    activation_key: str = "hidden_act"
    """The config key naming the MLP's activation (Gemma 2/3: ``hidden_activation``)."""
    moe: MixtureOfExperts | None = None
    """The MLPs are mixtures of experts (Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss, DeepSeek), configured so."""
    attention_sinks: bool = False
    """Each attention head has a learned logit (``self_attn.sinks``) in its softmax, with no
    value (gpt-oss)."""
    latent_attention: bool = False
    """Multi-head latent attention (DeepSeek-V2/V3, `pagedrs.models.mla`): the cache holds one
    compressed latent per token, not per-head keys and values."""


LLAMA = Family()

# architecture -> (model class, family); `model_type` -> architecture for GGUF files (which
# name no architecture).
_ROWS: dict[str, tuple[str, Family]] = {
    "LlamaForCausalLM": ("decoder", LLAMA),
    "MistralForCausalLM": ("decoder", Family(window_on_every_layer=True)),
    "Qwen2ForCausalLM": ("decoder", Family(qkv_bias=True)),
    "Qwen3ForCausalLM": ("decoder", Family(qk_norm="head")),
    "GemmaForCausalLM": ("decoder", Family(norm="gemma", embedding_scale="sqrt_hidden")),
    "Gemma2ForCausalLM": (
        "decoder",
        Family(
            norm="gemma",
            embedding_scale="sqrt_hidden",
            norm_placement="sandwich",
            query_pre_attn_scalar=True,
            activation_key="hidden_activation",
        ),
    ),
    "Gemma3ForCausalLM": (
        "decoder",
        Family(
            qk_norm="head",
            norm="gemma",
            embedding_scale="sqrt_hidden",
            norm_placement="sandwich",
            query_pre_attn_scalar=True,
            activation_key="hidden_activation",
        ),
    ),
    "Phi3ForCausalLM": ("decoder", Family(window_on_every_layer=True, fused_checkpoint=True, partial_rotary=True)),
    "GraniteForCausalLM": ("decoder", Family(embedding_scale="multiplier", granite_multipliers=True)),
    "Olmo2ForCausalLM": ("decoder", Family(qk_norm="full", norm="float32", norm_placement="post")),
    "MixtralForCausalLM": (
        "decoder",
        Family(
            window_on_every_layer=True,
            moe=MixtureOfExperts(
                num_experts_key="num_local_experts", width_key="intermediate_size", always_renormalize=True
            ),
        ),
    ),
    "Qwen2MoeForCausalLM": (
        "decoder",
        Family(qkv_bias_key="qkv_bias", moe=MixtureOfExperts(shared_expert=True, sparse_step=True)),
    ),
    "Qwen3MoeForCausalLM": ("decoder", Family(qk_norm="head", moe=MixtureOfExperts(sparse_step=True))),
    "OlmoeForCausalLM": ("decoder", Family(qk_norm="full", moe=MixtureOfExperts(width_key="intermediate_size"))),
    "GptOssForCausalLM": (
        "decoder",
        Family(
            norm="float32",
            attention_sinks=True,
            moe=MixtureOfExperts(num_experts_key="num_local_experts", width_key="intermediate_size", gpt_oss=True),
        ),
    ),
    "DeepseekV2ForCausalLM": (
        "decoder",
        Family(
            latent_attention=True,
            moe=MixtureOfExperts(num_experts_key="n_routed_experts", shared_expert=True, deepseek="v2"),
        ),
    ),
    "DeepseekV3ForCausalLM": (
        "decoder",
        Family(
            latent_attention=True,
            moe=MixtureOfExperts(num_experts_key="n_routed_experts", shared_expert=True, deepseek="v3"),
        ),
    ),
}
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}

SUPPORTED_ARCHITECTURES = tuple(_ROWS)


def supported_models() -> list[tuple[str, str, str]]:
    """``(architecture, model_type, checkpoint formats)`` of every registered architecture."""
    by_architecture = {architecture: model_type for model_type, architecture in _MODEL_TYPES.items()}
    gguf_names = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}  # llama.cpp's names, where they differ
    formats = {}
    for architecture in _ROWS:
        model_type = by_architecture.get(architecture, "-")
        formats[architecture] = (
            "safetensors, GGUF" if gguf_names.get(model_type, model_type) in GGUF_ARCHITECTURES else "safetensors"
        )
    return [(architecture, by_architecture.get(architecture, "-"), formats[architecture]) for architecture in _ROWS]


CLASSIFIER_SUFFIX = "ForSequenceClassification"
"""A registered family's ``*ForSequenceClassification`` checkpoints run as its decoder with a
classifier head (``score``) instead of the language-model head."""


def architecture_of(config: Any) -> str:
    """The architecture named by ``config.architectures`` (or, for GGUF files, which carry
    none, by ``config.model_type``)."""
    names = list(getattr(config, "architectures", None) or [])
    if not names and getattr(config, "model_type", None) in _MODEL_TYPES:
        names = [_MODEL_TYPES[config.model_type]]
    for name in names:
        if name in _ROWS:
            return name
        causal = name.removesuffix(CLASSIFIER_SUFFIX) + "ForCausalLM"
        if name.endswith(CLASSIFIER_SUFFIX) and causal in _ROWS:
            return causal
    raise ValueError(
        f"unsupported model architecture {names or getattr(config, 'model_type', None)!r}; "
        f"pagedrs supports {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def is_sequence_classifier(config: Any) -> bool:
    """Whether ``config`` names a sequence classifier whose head is its own ``score`` tensor
    (with ``classifier_from_token`` the head is built from the language-model head instead:
    the checkpoint is a causal model's)."""
    names = list(getattr(config, "architectures", None) or [])
    return bool(names) and names[0].endswith(CLASSIFIER_SUFFIX) and not getattr(config, "classifier_from_token", None)


def family_of(config: Any) -> Family:
    """The family settings of ``config``'s architecture."""
    return _ROWS[architecture_of(config)][1]


def model_class_of(config: Any) -> type:
    """The model class that runs ``config``'s architecture."""
    kind = _ROWS[architecture_of(config)][0]
    if kind == "decoder":
        from pagedrs.models.decoder import DecoderForCausalLM

        return DecoderForCausalLM
    raise AssertionError(f"no model class {kind!r}")
