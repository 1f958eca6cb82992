"""A dense model's decoder layers on the CPU as one compiled call per step
(``torch.classes.pagedrs_cpu.DecoderStack``, ``cpu/decoder_stack.cpp``).

The Python layers (`pagedrs.models.decoder`) issue ~140 small aten ops per layer; at one token
per step each costs more to dispatch than to compute, and in a single-stream decode of the
default model they took as long as the matmuls. The stack runs the same arithmetic (the same
matmuls, the same paged attention and SDPA split as `CpuAttentionMetadata`) in C++ over the
model's own parameters, which it holds by reference.

It runs where everything it needs holds: float32 activations and caches, one rank (no
all-reduce between the halves of a layer), the CPU attention backend, and every linear dense
float32 or packed in a format the CPU matmul kernel takes (not FP8). Mixture-of-experts layers
run in it too: the router, the fused experts (``cpu/moe.cpp``) and a shared expert in C++. `why_unsupported` says
which part does not; the model then runs its Python layers, which stay the reference for
every other case.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from pagedrs.attention import AttentionBackend, StepViews
from pagedrs.attention.cpu_backend import CpuAttentionMetadata
from pagedrs.kernels import cpu as cpu_kernels
from pagedrs.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedrs.layers.moe import ACTIVATION_IDS, SparseMoe
from pagedrs.layers.norm import RMSNorm
from pagedrs.layers.rotary import RotaryEmbedding
from pagedrs.lora.adapter import LINEARS

if TYPE_CHECKING:
    from pagedrs.lora.slots import LoRASlots
    from pagedrs.models.decoder import Attention, DecoderForCausalLM

F32 = 0
"""ggml's type id of float32: how the stack is told a linear is a dense float32 weight."""
MAX_HEAD_DIM = 512
"""The largest head size the stack's rotary step takes (``cpu/decoder_stack.cpp``)."""
ROPE_TABLE_BYTES = 64 << 20
"""Most bytes the rotary tables (`CpuDecoderStack.rope_tables`) may take; past the positions they
cover, steps compute their tokens' cos and sin as the Python layers do."""
MIN_ROPE_TABLE_ROWS = 1024
"""Positions the rotary tables cover at first; they double as positions pass their end."""


def _linear_type(module: nn.Module) -> int | None:
    """The stack's type id of a linear (F32 or a packed ggml type), or ``None`` if the stack
    cannot multiply by it."""
    from pagedrs.quant.layers import QuantColumnParallelLinear, QuantRowParallelLinear

    if type(module) in (ColumnParallelLinear, RowParallelLinear):
        return F32 if module.weight.dtype == torch.float32 else None
    if isinstance(module, (QuantColumnParallelLinear, QuantRowParallelLinear)):
        return module.kernel_type
    return None


def _head_type(model: DecoderForCausalLM) -> int | None:
    """The stack's type id of the model's language-model head (its vocabulary whole on one rank,
    dense float32 or packed), or ``None`` where the head stays the model's."""
    from pagedrs.layers.linear import VocabEmbedding
    from pagedrs.quant.layers import QuantVocabEmbedding

    head = model.embed_tokens if model.lm_head is None else model.lm_head
    if head.tp.size != 1 or head.weight.shape[0] != head.vocab_size:
        return None
    if type(head) is VocabEmbedding:
        return F32 if head.weight.dtype == torch.float32 else None
    return head.kernel_type if isinstance(head, QuantVocabEmbedding) else None


def _embedding_type(model: DecoderForCausalLM) -> int | None:
    """The stack's type id of the model's token embedding table (whole on one rank, float32 or
    packed, its rows the layers' input as they are), or ``None`` where the model looks its ids
    up itself."""
    from pagedrs.layers.linear import VocabEmbedding
    from pagedrs.quant.layers import QuantVocabEmbedding

    table = model.embed_tokens
    if model.embedding_scale != 1.0 or table.tp.size != 1 or table.weight.shape[0] != table.vocab_size:
        return None
    if type(table) is VocabEmbedding:
        return F32 if table.weight.dtype == torch.float32 else None
    return table.table_type if isinstance(table, QuantVocabEmbedding) and table.dtype == torch.float32 else None


def _linears(model: DecoderForCausalLM) -> list[nn.Module]:
    """Every decoder layer's linears: attention's two, then the MLP's two (a mixture's shared
    expert's, if it has one)."""
    linears: list[nn.Module] = []
    for layer in model.decoder_layers():
        attn, mlp = cast("Attention", layer.self_attn), layer.mlp  # not latent (`why_unsupported`)
        linears += [attn.qkv_proj, attn.o_proj]
        dense: Any = mlp.shared_expert if isinstance(mlp, SparseMoe) else mlp  # an MLP
        if dense is not None:
            linears += [dense.gate_up_proj, dense.down_proj]
    return linears


def why_unsupported(model: DecoderForCausalLM, device: torch.device, attention_backend: AttentionBackend) -> str | None:
    """Why the stack cannot run this model's layers, or ``None`` when it can."""
    if device.type != "cpu" or attention_backend.metadata is not CpuAttentionMetadata:  # the layout it reads
        return f"it runs on the CPU attention backend (this model uses {attention_backend.name!r} on {device})"
    if model.tp.size > 1:
        return "tensor parallelism all-reduces inside each layer"
    if model.latent_cache:
        return "it runs per-head keys and values, not latent attention (DeepSeek)"
    if model.head_dim % 2 or model.head_dim > MAX_HEAD_DIM:
        return f"it rotates even head sizes up to {MAX_HEAD_DIM} (this model's is {model.head_dim})"
    for layer in model.decoder_layers():
        mlp = layer.mlp
        if isinstance(mlp, SparseMoe) and mlp.experts.dtype != torch.float32:
            return f"experts of {mlp.experts.dtype} (it runs float32 or packed experts)"
        if isinstance(mlp, SparseMoe) and (_grouped_or_scaled(mlp) or _ungated_shared(mlp)):
            return "it routes by softmax or top-k logits, with one gated shared expert at most"
    if model.norm.weight.dtype != torch.float32:
        return f"it computes in float32 (the model is {model.norm.weight.dtype})"
    for linear in _linears(model):
        if _linear_type(linear) is None:
            return f"a linear of type {type(linear).__name__} ({linear.weight.dtype})"
    return None


def _grouped_or_scaled(moe: SparseMoe) -> bool:
    routing = moe.routing
    return routing.scoring != "softmax" or routing.num_groups > 1 or routing.scale != 1.0 or moe.score_bias is not None


def _ungated_shared(moe: SparseMoe) -> bool:
    return moe.shared_expert is not None and moe.shared_expert_gate is None


class CpuDecoderStack:
    """Runs every decoder layer of ``model`` for a step, in place on the hidden states."""

    def __init__(self, model: DecoderForCausalLM, layer_views: tuple[int, ...] | None = None):
        """``layer_views``: the attention view each layer reads (`pagedrs.engine.kv_layout`);
        default: one view for all."""
        cpu_kernels.load()
        config = model.config
        layer_views = layer_views if layer_views is not None else (0,) * len(model.layer_specs)
        rope_keys = list(model.ropes)
        self._ropes = [cast(RotaryEmbedding, rope) for rope in model.ropes.values()]
        self._rope_tables: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Each rotary embedding's cos and sin of positions ``0 .. P - 1`` (`rope_tables`)."""
        self._held: list[torch.Tensor] = []
        """Weights the stack reads that the model does not hold (Gemma's ``1 + w`` norms)."""
        self.has_lora = False
        """Whether the stack adds LoRA updates (`attach_lora`)."""
        self._stack: Any = torch.classes.pagedrs_cpu.DecoderStack(
            config.hidden_size,
            model.num_heads,
            model.num_kv_heads,
            model.head_dim,
            config.intermediate_size,
            float(model.norm.eps),
        )
        # NOTE: the method looked up once: a ScriptObject makes a new method object at each
        # lookup. Per call after a step, cold: ~70 us for a method looked up, ~45 us bound; in a
        # single-stream int8 decode step the stack's call 4.257 -> 4.235 ms (Zen 4 VM, steps
        # alternated, 1,260 each).
        self._forward = self._stack.forward
        self._stack.set_final_norm(self._weight_of(model.norm))
        head_type = None if model.sequence_classifier else _head_type(model)
        if head_type is not None:
            head = model.embed_tokens if model.lm_head is None else model.lm_head
            self._stack.set_head(head.weight, head_type)
        self.has_head = head_type is not None
        """Whether the stack's call can end with the head's logits (``logits=True``)."""
        embedding_type = _embedding_type(model)
        if embedding_type is not None:
            self._stack.set_embedding(model.embed_tokens.weight, embedding_type)
        self.embeds = embedding_type is not None
        """Whether the stack's call takes the step's token ids for ``hidden`` (it looks up their
        rows of the model's embedding table itself)."""
        for layer, spec, view in zip(model.decoder_layers(), model.layer_specs, layer_views):
            attn, mlp = cast("Attention", layer.self_attn), layer.mlp
            norms = [
                layer.input_layernorm,
                # "pre" blocks: post_attention_layernorm is the norm before the MLP (its HF name).
                layer.post_attention_layernorm if layer.placement != "pre" else None,
                layer.post_attention_layernorm if layer.placement == "pre" else layer.pre_feedforward_layernorm,
                layer.post_feedforward_layernorm,
                attn.q_norm,
                attn.k_norm,
            ]
            args: list[Any] = [None if norm is None else self._weight_of(norm) for norm in norms]
            for linear in (attn.qkv_proj, attn.o_proj):
                args += [linear.weight, _linear_type(linear), linear.bias]
            if isinstance(mlp, SparseMoe):
                args += [None, F32, None, None, F32, None]  # the experts follow (set_experts)
            else:
                for linear in (mlp.gate_up_proj, mlp.down_proj):
                    args += [linear.weight, _linear_type(linear), linear.bias]
            args += [
                ACTIVATION_IDS[mlp.experts.activation.name if isinstance(mlp, SparseMoe) else mlp.activation],
                layer.residual_multiplier,
                spec.scale,
                spec.window or 0,
                spec.softcap or 0.0,
                rope_keys.index(spec.rope),
                view,
                attn.sinks,
            ]
            self._stack.add_layer(*args)
            if isinstance(mlp, SparseMoe):
                self._set_experts(mlp)

    def _set_experts(self, moe: SparseMoe) -> None:
        experts = moe.experts
        shared: Any = moe.shared_expert  # an MLP
        self._stack.set_experts(
            moe.gate,
            moe.gate_bias,
            moe.routing.top_k,
            moe.routing.renormalize,
            moe.routing.softmax_after_topk,
            experts.gate_up,
            experts.gate_up_type,
            experts.down,
            experts.down_type,
            experts.gate_up_bias,
            experts.down_bias,
            experts.activation.alpha,
            experts.activation.limit,
            None if shared is None else shared.gate_up_proj.weight,
            F32 if shared is None else _linear_type(shared.gate_up_proj),
            None if shared is None else shared.down_proj.weight,
            F32 if shared is None else _linear_type(shared.down_proj),
            moe.shared_expert_gate,
            moe.expert_tokens,
        )

    def attach_lora(self, slots: LoRASlots) -> None:
        """Gives the stack the adapters' slots of every patched linear (held by reference, so
        adapters loaded into the slots later are seen)."""
        for (layer, linear), a in slots.a.items():
            self._stack.set_lora(layer, LINEARS.index(linear), a, slots.b[(layer, linear)])
        self.has_lora = True

    def rope_tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Each rotary embedding's cos and sin (float32 ``[P, rotary_dim]``) of positions ``0 ..
        P - 1``, ``P`` past every one of ``positions``: the stack's call reads each token's rows
        there (``rope_rows``) instead of rows computed per step. Built on first use and doubled
        as positions pass their end; ``None`` where positions alone do not fix the rotation (a
        length-dependent embedding) or the tables would outgrow `ROPE_TABLE_BYTES`.

        NOTE: a single-stream decode step spent ~60 us computing its token's cos and sin (torch
        ops, run cold after the step's weights streamed through the caches). A table's row is
        what `RotaryEmbedding.cos_sin` gives that position (elementwise, the same values)."""
        if not self._ropes or any(rope.length_dependent for rope in self._ropes) or not len(positions):
            return None
        end = max(positions.tolist()) + 1  # (a list: ~30 us less than numpy's max, cold)
        rows = len(self._rope_tables[0][0]) if self._rope_tables else 0
        if end <= rows:
            return self._rope_tables
        rows = max(MIN_ROPE_TABLE_ROWS, rows)
        while rows < end:
            rows *= 2
        if rows * sum(rope.rotary_dim for rope in self._ropes) * 8 > ROPE_TABLE_BYTES:
            return None
        every = torch.arange(rows)
        self._rope_tables = [rope.cos_sin(every, torch.float32) for rope in self._ropes]
        return self._rope_tables

    def set_one_region(self, enabled: bool) -> None:
        """Whether steps of a few rows (decodes) run every layer in one parallel region (the
        default) or each linear and attention in its own; the values are the same bit for bit
        (tests and benchmarks compare the two)."""
        self._stack.set_one_region(enabled)

    @property
    def one_region_steps(self) -> int:
        """How many steps ran in one parallel region so far."""
        return int(self._stack.one_region_steps())

    def set_lora_rows(self, row_slots: torch.Tensor | None) -> None:
        """Each row's slot (int64, -1: none) for the next calls, or ``None``."""
        self._stack.set_lora_rows(row_slots)

    def _weight_of(self, norm: RMSNorm) -> torch.Tensor:
        """What the stack multiplies a norm's output by: its weight, or Gemma's ``1 + w``."""
        if norm.style != "gemma":
            return norm.weight  # "llama" and "float32" compute the same in float32
        shifted = 1.0 + norm.weight.float()
        self._held.append(shifted)
        return shifted

    def __call__(
        self,
        hidden: torch.Tensor,
        cos_sin: list[tuple[torch.Tensor, torch.Tensor]],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: CpuAttentionMetadata | StepViews[CpuAttentionMetadata],
        rows: torch.Tensor,
        rope_rows: torch.Tensor | None = None,
        logits: bool = False,
    ) -> torch.Tensor:
        """Runs every layer over the step's rows; returns the ``rows`` tokens' last hidden
        states through the model's final norm (float32 ``[len(rows), hidden_size]``, as
        ``model.norm(hidden[rows])``; computed in the same call, while they are in cache).

        ``hidden``: ``float32 [num_tokens, hidden_size]``, the embeddings, overwritten with the
        last layer's output, or where `embeds` the step's token ids (``int64 [num_tokens]``);
        ``cos_sin``: ``float32 [num_tokens, rotary_dim]`` pairs, one per rotary embedding of the
        model (in `model.ropes`'s order), or with ``rope_rows`` (each token's position, ``int64
        [num_tokens]``) `rope_tables`, token ``t`` reading their row ``rope_rows[t]``;
        ``kv_caches``: one ``[num_blocks, block_size, num_kv_heads, head_dim]`` pair per layer,
        this step's keys and values written at each view's ``slot_mapping``; ``meta``: the
        step's metadata, or one per attention view (they share their rows and chunks; their
        slots, block tables and masks differ)."""
        metas = meta.metas if isinstance(meta, StepViews) else [meta]
        first = metas[0]
        kernel = first.kernel
        chunks = first.sdpa_chunks
        return self._forward(
            hidden,
            [cos for cos, _ in cos_sin],
            [sin for _, sin in cos_sin],
            [key for key, _ in kv_caches],
            [value for _, value in kv_caches],
            [each.slot_mapping for each in metas],
            None if kernel is None else kernel.rows,
            [each.kernel.block_tables for each in metas if each.kernel is not None],
            None if kernel is None else kernel.cu_seqlens_q,
            None if kernel is None else kernel.context_lens,
            [bound for chunk in chunks for bound in (chunk.start, chunk.end, chunk.context_len)],
            [chunk.blocks for each in metas for chunk in each.sdpa_chunks],
            [chunk.mask for each in metas for chunk in each.sdpa_chunks],
            rows if rows.dtype == torch.int64 else rows.long(),
            rope_rows if rope_rows is None or rope_rows.dtype == torch.int64 else rope_rows.long(),
            logits,
        )
