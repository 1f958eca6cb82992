"""The Llama family on the paged cache: Llama, Mistral, Qwen2 (q/k/v biases) and Qwen3
(per-head q/k RMSNorm). One implementation, switched by the Hugging Face config."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedrs.attention import AttentionMetadata
from pagedrs.checkpoint import WeightHandle
from pagedrs.layers import fused
from pagedrs.layers.linear import ColumnParallelLinear, RowParallelLinear, TensorParallel, VocabEmbedding
from pagedrs.layers.norm import RMSNorm
from pagedrs.layers.rotary import RotaryEmbedding, apply_rotary, rope_theta

if TYPE_CHECKING:
    from pagedrs.attention.cpu_backend import CpuAttentionMetadata
    from pagedrs.models.cpu_stack import CpuDecoderStack


class Attention(nn.Module):
    def __init__(self, config: Any, tp: TensorParallel, dtype: torch.dtype, *, bias: bool, qk_norm: bool):
        super().__init__()
        # Qwen2 has q/k/v biases whatever the config says; `attention_bias` (Llama, Mistral,
        # Qwen3) puts biases on q/k/v and on the output projection.
        output_bias = bool(getattr(config, "attention_bias", False))
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = tp.split(config.num_attention_heads, "num_attention_heads")
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        # NOTE: with fewer KV heads than ranks, each rank holds one KV head (a copy of it on
        # `kv_replicas` ranks), serving the query heads that share it.
        kv_replicas = tp.replicas(num_kv_heads, "num_key_value_heads")
        self.num_kv_heads = num_kv_heads * kv_replicas // tp.size
        self.scale = self.head_dim**-0.5
        q_size, kv_size = config.num_attention_heads * self.head_dim, num_kv_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, [q_size, kv_size, kv_size], bias, tp, dtype, replicas=[1, kv_replicas, kv_replicas]
        )
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, output_bias, tp, dtype)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None

    def forward(self, hidden, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = meta.attend(q, k, v, kv_cache[0], kv_cache[1], self.scale)
        return self.o_proj(out.reshape(-1, q_size))


class MLP(nn.Module):
    def __init__(self, config: Any, tp: TensorParallel, dtype: torch.dtype):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"activation {config.hidden_act!r} is not supported (only silu)")
        intermediate = config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [intermediate, intermediate], bias, tp, dtype)
        self.down_proj = RowParallelLinear(intermediate, config.hidden_size, bias, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused.enabled(gate_up):
            return self.down_proj(fused.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, tp: TensorParallel, dtype: torch.dtype, *, bias: bool, qk_norm: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, tp, dtype, bias=bias, qk_norm=qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, tp, dtype)

    def forward(self, hidden, cos, sin, kv_cache, meta):
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        if fused.enabled(hidden):  # the residual add and the norm after it in one kernel (GPU)
            norm = self.post_attention_layernorm
            hidden, normed = fused.add_rms_norm(hidden, attended, norm.weight, norm.eps)
            return hidden + self.mlp(normed)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaFamilyForCausalLM(nn.Module):
    """Decoder-only model of the Llama family for a flat batch of tokens."""

    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel, *, bias: bool, qk_norm: bool):
        super().__init__()
        self.config = config
        self.tp = tp
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        layers = [DecoderLayer(config, tp, dtype, bias=bias, qk_norm=qk_norm) for _ in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = (
            None if self.tie_word_embeddings else VocabEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        )
        attn = layers[0].self_attn
        self.rotary = RotaryEmbedding(attn.head_dim, rope_theta(config))
        self.num_kv_heads = attn.num_kv_heads
        self.num_heads = attn.num_heads
        self.head_dim = attn.head_dim
        self.sliding_window = getattr(config, "sliding_window", None) if self._uses_sliding_window(config) else None

    def decoder_layers(self) -> list[DecoderLayer]:
        """The decoder layers, typed."""
        return cast(list[DecoderLayer], list(self.layers))  # ModuleList's stubs lose the element type

    @staticmethod
    def _uses_sliding_window(config: Any) -> bool:
        if getattr(config, "model_type", "") == "mistral":
            return getattr(config, "sliding_window", None) is not None
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window layers of Qwen2/Qwen3 are not supported yet")
        return False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        decoder_stack: CpuDecoderStack | None = None,
    ) -> torch.Tensor:
        """Runs the step's tokens; returns float32 logits of the ``logits_indices`` rows.
        ``decoder_stack``: the layers as one compiled call on the CPU, when the runner picked
        that strategy (`pagedrs.models.cpu_stack`); ``None``: the Python layers."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        if decoder_stack is not None:
            # NOTE: the stack overwrites `hidden` in place; the embedding lookups return a new
            # tensor (never a view of the weights), so nothing else sees it change.
            decoder_stack(hidden, cos, sin, kv_caches, cast("CpuAttentionMetadata", meta))
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                hidden = layer(hidden, cos, sin, kv_cache, meta)
        hidden = self.norm(hidden[logits_indices])
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return head.logits(hidden).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, WeightHandle]]) -> None:
        """Loads Hugging Face checkpoint tensors (lazy handles of the full tensors), each into
        this rank's shard, reading only that shard. Fails on a missing or unexpected tensor."""
        loaded: set[str] = set()
        expected = {name for name, _ in self.named_parameters()}
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            for target in self._load_one(name, tensor):
                loaded.add(target)
        if self.tie_word_embeddings:
            loaded.add("lm_head.weight")
        missing = {name for name in expected if name not in loaded}
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _load_one(self, name: str, tensor: WeightHandle) -> list[str]:
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
            self.norm.weight.copy_(tensor[:])
            return ["norm.weight"]
        parts = name.split(".")
        if parts[0] != "layers":
            raise ValueError(f"unexpected checkpoint tensor {name!r}")
        layer = cast(DecoderLayer, self.layers[int(parts[1])])  # ModuleList's stubs lose the element type
        prefix = f"layers.{parts[1]}."
        rest, kind = ".".join(parts[2:-1]), parts[-1]
        attn, mlp = layer.self_attn, layer.mlp
        fused = {
            "self_attn.q_proj": (attn.qkv_proj, 0, "self_attn.qkv_proj"),
            "self_attn.k_proj": (attn.qkv_proj, 1, "self_attn.qkv_proj"),
            "self_attn.v_proj": (attn.qkv_proj, 2, "self_attn.qkv_proj"),
            "mlp.gate_proj": (mlp.gate_up_proj, 0, "mlp.gate_up_proj"),
            "mlp.up_proj": (mlp.gate_up_proj, 1, "mlp.gate_up_proj"),
        }
        if rest in fused:
            module, shard, target = fused[rest]
            (module.load if kind == "weight" else module.load_bias)(shard, tensor)
            return [f"{prefix}{target}.{kind}"]
        if rest in ("self_attn.o_proj", "mlp.down_proj"):
            projection = attn.o_proj if rest == "self_attn.o_proj" else mlp.down_proj
            (projection.load if kind == "weight" else projection.load_bias)(tensor)
            return [f"{prefix}{rest}.{kind}"]
        norms = {
            "input_layernorm": layer.input_layernorm,
            "post_attention_layernorm": layer.post_attention_layernorm,
            "self_attn.q_norm": attn.q_norm,
            "self_attn.k_norm": attn.k_norm,
        }
        norm = norms.get(rest)
        if norm is not None:
            norm.weight.copy_(tensor[:])
            return [f"{prefix}{rest}.weight"]
        raise ValueError(f"unexpected checkpoint tensor {name!r}")
