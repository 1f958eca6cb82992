"""Tiny GGUF files written from a transformers Llama, as llama.cpp's converter writes them:
- ``TYPES``: a stored type per tensor: every 32-weight-block format, mixed and float linears.
- ``K_CONFIG``, ``K_TYPES``: a Q4_K_M-like mix on a model of whole 256-weight blocks.
- `write_gguf`: the file, q/k rows in llama.cpp's order, a tiny SentencePiece vocabulary."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants

from tests.helpers.checkpoints import TINY
from tests.helpers.k_quants import K_QUANTS, random_k_blocks

Q8_0, Q4_0, Q4_1, F32 = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, None)

# GGUF name -> stored type: every kernel format, a fused q/k/v of mixed types (loaded dense),
# and a float linear (loaded dense).
TYPES = {
    "token_embd": Q8_0,
    "output": Q4_1,
    "blk.0.attn_q": Q4_0,
    "blk.0.attn_k": Q4_0,
    "blk.0.attn_v": Q4_0,
    "blk.0.attn_output": Q8_0,
    "blk.0.ffn_gate": Q4_1,
    "blk.0.ffn_up": Q4_1,
    "blk.0.ffn_down": Q4_0,
    "blk.1.attn_q": Q8_0,
    "blk.1.attn_k": Q4_1,
    "blk.1.attn_v": Q4_1,
    "blk.1.attn_output": Q4_1,
    "blk.1.ffn_gate": Q8_0,
    "blk.1.ffn_up": Q8_0,
    "blk.1.ffn_down": F32,
}

Q4_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K
# Like llama.cpp's Q4_K_M: Q4_K, with Q6_K for the head, the down projections and (in one
# layer) the v projection, which makes that layer's fused q/k/v mixed (loaded dense); on a
# model whose linears are whole 256-weight blocks.
K_CONFIG = dict(TINY, hidden_size=256, intermediate_size=512)
K_TYPES = {"token_embd": Q4_K, "output": Q6_K} | {
    f"blk.{layer}.{part}": Q6_K if part == "ffn_down" or (layer == 1 and part == "attn_v") else Q4_K
    for layer in (0, 1)
    for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
}

_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
}
# A mixture's stacked experts as llama.cpp stores them: one 3-D tensor per projection.
_EXPERTS = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}


# Per architecture, llama.cpp's names that differ from the Llama family's. Written out here
# rather than inverted from pagedrs's reader (`checkpoint.gguf`): the files must be llama.cpp's,
# not a mirror of what the reader expects.
ARCH_NAMES = {
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
    "gemma2": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
}
ARCH_NAMES["gemma3"] = ARCH_NAMES["gemma2"]
ARCH_NAMES["olmo2"] = {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}
GEMMA = {"gemma", "gemma2", "gemma3"}
"""Architectures whose converter stores each norm as 1 + w."""


def gguf_name(name: str, architecture: str = "llama") -> str:
    if name.startswith("model.layers."):
        _, _, layer, *rest = name.split(".")
        names = {**_HF_TO_GGUF, **ARCH_NAMES.get(architecture, {})}
        return f"blk.{layer}.{names['.'.join(rest[:-1])]}.{rest[-1]}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}.get(
        name, "output.weight"
    )


def _tensors(model, architecture: str):
    """``(float32 array, GGUF name)`` of every tensor the file holds: a
    mixture's stacked ``gate_up_proj`` split into its gate and up halves."""
    config = model.config
    for name, tensor in model.state_dict().items():
        if "rotary" in name or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        array = tensor.float().numpy()
        if ".mlp.experts." in name:
            layer = name.split(".")[2]
            if name.endswith("gate_up_proj"):
                half = array.shape[1] // 2
                yield np.ascontiguousarray(array[:, :half]), f"blk.{layer}.{_EXPERTS['gate']}.weight"
                yield np.ascontiguousarray(array[:, half:]), f"blk.{layer}.{_EXPERTS['up']}.weight"
            else:
                yield array, f"blk.{layer}.{_EXPERTS['down']}.weight"
            continue
        yield array, gguf_name(name, architecture)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for q and k (the inverse of what loaders undo)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def llama3_rope_factors(config) -> np.ndarray:
    """Llama 3's rotary scaling as llama.cpp's converter stores it (``rope_freqs``): one
    divisor per frequency."""
    import math

    params = config.rope_parameters
    base, dim = params["rope_theta"], config.hidden_size // config.num_attention_heads
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_phi3_longrope(writer: GGUFWriter, config) -> None:
    """Phi-3's LongRoPE as llama.cpp's converter writes it: the factors as tensors, the original
    context and the cos/sin scale in the metadata."""
    import math

    params = config.rope_parameters
    original = params["original_max_position_embeddings"]
    scale = config.max_position_embeddings / original
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    writer.add_tensor("rope_factors_long.weight", np.array(params["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(params["short_factor"], dtype=np.float32))


def write_gguf(
    path: str,
    model,
    types: dict,
    extra_tensors: dict | None = None,
    extra_metadata: dict | None = None,
    architecture: str = "llama",
) -> None:
    """``model`` (a transformers Llama) as a GGUF file with a tiny SentencePiece vocabulary.
    Tensors given a k-quant type hold random blocks instead (gguf.quants cannot quantize to
    them): the oracle must then load the file itself. ``extra_tensors`` (GGUF name -> float32
    array, e.g. ``rope_freqs.weight``) and ``extra_metadata`` (key -> string) are written too.
    ``architecture``: as llama.cpp's converter writes it: ``llama`` (q/k rows permuted),
    ``granite`` (permuted as llama, its multipliers), ``olmo2`` (its post-norms), ``gemma``
    (norms as 1 + w), ``phi3`` (q/k/v and gate/up fused, its window and rotary dimension), ``gemma2`` (its norm
    names, each norm as 1 + w, its softcaps and window), ``gemma3`` (Gemma 2's names and norms,
    q/k norms, the window, the global layers' rotary base and linear scaling; the pattern of
    local layers and their base are llama.cpp's fixed ones, not in the file)."""
    config = model.config
    writer = GGUFWriter(path, architecture)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary_dim = head_dim
    if architecture == "phi3":
        rotary_dim = int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
        if config.sliding_window is not None:
            writer.add_sliding_window(config.sliding_window)
        if config.rope_parameters["rope_type"] == "longrope":
            _add_phi3_longrope(writer, config)
    if architecture == "gemma2":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(config.sliding_window)
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    rope_base = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
    if architecture == "gemma":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if architecture == "granite":  # llama.cpp's names for Granite's multipliers
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if num_experts:  # Mixtral (as `llama`) and Qwen3-MoE (`qwen3moe`)
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if architecture == "qwen3moe":
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
    if architecture == "gemma3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(config.sliding_window)
        global_rope = config.rope_parameters["full_attention"]
        rope_base = global_rope["rope_theta"]
        if global_rope["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(global_rope["factor"])
    for key, value in (extra_metadata or {}).items():
        writer.add_string(key, value)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(rope_base)
    writer.add_rope_dimension_count(rotary_dim)
    writer.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"\u2581w{i}" for i in range(3, config.vocab_size)]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for array, target in _tensors(model, architecture):
        if architecture in GEMMA and target.endswith("norm.weight"):
            array = array + 1  # llama.cpp's Gemma converter stores 1 + w
        if architecture in ("llama", "granite") and ".attn_q." in target:
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif architecture in ("llama", "granite") and ".attn_k." in target:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        qtype = types.get(target.removesuffix(".weight")) if array.ndim >= 2 else None
        if qtype is None:
            writer.add_tensor(target, array)
        elif qtype in K_QUANTS:
            matrices = array.reshape(-1, *array.shape[-2:])
            blocks = np.stack(
                [
                    random_k_blocks(qtype, *matrix.shape, seed=len(target) + i, scale_range=(1e-4, 4e-4), centred=True)
                    for i, matrix in enumerate(matrices)
                ]
            )
            writer.add_tensor(target, blocks.reshape(*array.shape[:-1], -1), raw_dtype=qtype)
        else:
            writer.add_tensor(target, quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
