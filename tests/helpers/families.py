"""Tiny random-weight checkpoints of every registered family and rotary variant, saved by
transformers (the oracle), and an HF greedy loop that also returns each chosen token's logprob.

``FAMILIES``: id -> a function making the transformers config, in the `TINY` shape; windows of
8 tokens and an ``original_max_position_embeddings`` of 32, so the test prompts (37 tokens,
then 24 generated) run past both."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from tests.helpers.checkpoints import TINY, save_word_tokenizer

WINDOW = 8
ORIGINAL_MAX = 32


def _llama(**extra):
    import transformers

    return transformers.LlamaConfig(**{**TINY, **extra})


def _rope(rope_type: str, **extra) -> dict[str, Any]:
    return {"rope_type": rope_type, "rope_theta": 10000.0, **extra}


def _phi3(**extra):
    import transformers

    rotary_half = int(16 * extra.pop("partial", 1.0)) // 2
    longrope = _rope(
        "longrope",
        short_factor=[1.0 + 0.1 * i for i in range(rotary_half)],
        long_factor=[2.0 + 0.5 * i for i in range(rotary_half)],
        original_max_position_embeddings=ORIGINAL_MAX,
    )
    return transformers.Phi3Config(**TINY, rope_parameters=longrope, pad_token_id=0, eos_token_id=1, **extra)


def _gemma(version: int, num_hidden_layers: int | None = None):
    import transformers

    shape = {**TINY, "head_dim": 16}
    if version == 1:
        return transformers.GemmaConfig(**shape)
    if version == 2:
        return transformers.Gemma2Config(
            **shape,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        )
    # Gemma 3's text model: sliding layers with their own base, a global one scaled linearly.
    layers = num_hidden_layers or 3
    return transformers.Gemma3TextConfig(
        **{**shape, "num_hidden_layers": layers},
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
        rope_parameters={
            "sliding_attention": _rope("default"),
            "full_attention": _rope("linear", factor=4.0, rope_theta=1e6),
        },
    )


def _qwen(version: int, **extra):
    import transformers

    cls = transformers.Qwen2Config if version == 2 else transformers.Qwen3Config
    shape = {**TINY, "head_dim": 16} if version == 3 else dict(TINY)
    return cls(**shape, **extra)


FAMILIES: dict[str, Callable[[], Any]] = {
    "llama3-rope": lambda: _llama(
        rope_parameters=_rope(
            "llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=ORIGINAL_MAX,
        )
    ),
    "llama-linear": lambda: _llama(rope_parameters=_rope("linear", factor=4.0)),
    "llama-dynamic": lambda: _llama(max_position_embeddings=ORIGINAL_MAX, rope_parameters=_rope("dynamic", factor=4.0)),
    "llama-yarn": lambda: _llama(
        rope_parameters=_rope("yarn", factor=4.0, original_max_position_embeddings=ORIGINAL_MAX)
    ),
    "qwen2-yarn": lambda: _qwen(
        2, rope_parameters=_rope("yarn", factor=4.0, original_max_position_embeddings=ORIGINAL_MAX)
    ),
    "qwen2-sliding": lambda: _qwen(2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3-sliding": lambda: _qwen(3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "gemma": lambda: _gemma(1),
    "gemma2": lambda: _gemma(2),
    "gemma3": lambda: _gemma(3),
    # Gemma 3 as llama.cpp runs every Gemma 3 GGUF: five local layers (base 10,000), then a
    # global one; the attention scaled by the head size.
    "gemma3-llama.cpp": lambda: _gemma(3, num_hidden_layers=6),
    "phi3-longrope": lambda: _phi3(),
    "phi3-partial-sliding": lambda: _phi3(partial=0.5, partial_rotary_factor=0.5, sliding_window=WINDOW),
    # Phi-4-mini's shape: partial rotary with the plain rotary, a window.
    "phi3-mini": lambda: __import__("transformers").Phi3Config(
        **TINY, partial_rotary_factor=0.5, sliding_window=WINDOW, pad_token_id=0, eos_token_id=1
    ),
    "granite": lambda: __import__("transformers").GraniteConfig(
        **TINY, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=0.5
    ),
    "olmo2": lambda: __import__("transformers").Olmo2Config(**TINY, pad_token_id=0, eos_token_id=1),
    # Mixtures of experts: odd expert counts, top-k 2 to 4, a window on every Mixtral layer,
    # Qwen2-MoE's shared expert and a dense layer (mlp_only_layers), Qwen3-MoE's dense first
    # layer (decoder_sparse_step 2), OLMoE's full-width q/k norms.
    "mixtral": lambda: __import__("transformers").MixtralConfig(
        **TINY, num_local_experts=5, num_experts_per_tok=2, sliding_window=WINDOW
    ),
    "qwen2-moe": lambda: __import__("transformers").Qwen2MoeConfig(
        **TINY,
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=96,
        mlp_only_layers=[1],
    ),
    "qwen3-moe": lambda: __import__("transformers").Qwen3MoeConfig(
        **{**TINY, "head_dim": 16},
        num_experts=8,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=2,
    ),
    "olmoe": lambda: __import__("transformers").OlmoeConfig(
        **TINY, num_experts=7, num_experts_per_tok=2, pad_token_id=0, eos_token_id=1
    ),
    # gpt-oss: attention sinks, alternating sliding / full layers, YaRN (not truncated), biases on
    # the router and the experts, top-k logits then softmax, a clamped SwiGLU whose limit clamps.
    "gpt-oss": lambda: __import__("transformers").GptOssConfig(
        **{**TINY, "head_dim": 16},
        num_local_experts=5,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        swiglu_limit=0.2,
        rope_parameters=_rope(
            "yarn",
            factor=8.0,  # max_model_len 256: the tensor-parallel test's 150-token prompt fits
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=ORIGINAL_MAX,
        ),
        pad_token_id=0,
        eos_token_id=1,
    ),
    # DeepSeek's latent attention (key and value sizes apart, V3 with a query latent and YaRN's
    # mscale in the softmax scale), a dense first layer, shared experts, group-limited routing
    # (V2 by the best expert of a group, V3 by the best two, with a correction bias and a
    # renormalization) and a routed scaling factor.
    "deepseek-v2": lambda: _deepseek(
        2, q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5
    ),
    "deepseek-v3": lambda: _deepseek(
        3,
        q_lora_rank=24,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters=_rope(
            "yarn",
            factor=8.0,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=0.9,
            mscale_all_dim=1.0,
            original_max_position_embeddings=ORIGINAL_MAX,
        ),
    ),
}


def _deepseek(version: int, **extra):
    import transformers

    cls = transformers.DeepseekV2Config if version == 2 else transformers.DeepseekV3Config
    return cls(
        **{**TINY, "num_key_value_heads": TINY["num_attention_heads"]},  # MLA has no KV heads of its own
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        pad_token_id=0,
        eos_token_id=1,
        **extra,
    )


def save_family(name: str, directory) -> Any:
    """Saves family ``name``'s tiny random checkpoint with a word-level tokenizer; returns the
    transformers model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(FAMILIES[name]()).eval()
    with torch.no_grad():  # random weights give nearly flat logits: make greedy choices clear
        model.get_output_embeddings().weight.mul_(4)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's, zero when built
                buffer.normal_(0.0, 0.05)
    model.save_pretrained(directory)
    save_word_tokenizer(directory, TINY["vocab_size"])
    return model


def save_unreadable_family(name: str, directory, change: dict[str, Any]) -> None:
    """Saves family ``name`` with ``change`` applied to its config.json and its weights made
    unreadable, so a refusal must come before any weight is read."""
    import json

    save_family(name, directory)
    config_path = directory / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **change}))
    for weights in directory.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")  # reading any weight would fail otherwise


def reset_rotary_state(model) -> None:
    """transformers' dynamic NTK rotary keeps the longest length it saw across calls: start
    each prompt from the original frequencies, as a fresh model would."""
    rotary = model.model.rotary_emb
    if hasattr(rotary, "original_inv_freq") and hasattr(rotary, "original_max_seq_len"):
        rotary.inv_freq = rotary.original_inv_freq.clone()
        rotary.max_seq_len_cached = rotary.original_max_seq_len


def hf_greedy_logprobs(model, prompt: list[int], num_tokens: int) -> tuple[list[int], list[float], list[float]]:
    """Greedy tokens from transformers' own model and KV cache (the whole prompt in one pass,
    then one token a pass), each token's logprob, and the gap between each step's top two
    logits (to tell a near tie)."""
    reset_rotary_state(model)
    tokens, logprobs, gaps = [], [], []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        result = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(num_tokens):
            logits = result.logits[0, -1].float()
            token = int(logits.argmax())
            top2 = logits.topk(2).values
            tokens.append(token)
            logprobs.append(float(logits.log_softmax(-1)[token]))
            gaps.append(float(top2[0] - top2[1]))
            result = model(torch.tensor([[token]]), past_key_values=result.past_key_values, use_cache=True)
    return tokens, logprobs, gaps
