"""Runs one scheduled batch through the model on the paged KV cache."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedrs._core import SchedulerOutput
from pagedrs.attention import AttentionBackend, StepViews, select_backend
from pagedrs.config import resolve_kv_cache_dtype
from pagedrs.engine.cuda_graphs import DecodeGraphs, GraphSettings, capture_cuda_graph
from pagedrs.engine.kv_layout import KVLayout
from pagedrs.engine.staging import StagedInputs
from pagedrs.engine.step_arrays import StepArrays, StepLogits
from pagedrs.inference_mode import inference_mode
from pagedrs.layers.linear import TensorParallel
from pagedrs.layers.moe import SparseMoe
from pagedrs.layers.rotary import rope_lengths
from pagedrs.models import build_model
from pagedrs.models.cpu_stack import CpuDecoderStack, why_unsupported
from pagedrs.models.decoder import DecoderForCausalLM
from pagedrs.models.loader import load_config, resolve_model
from pagedrs.quant.layers import use_int8_activations, use_scales_first
from pagedrs.quant.loading import load_weights

if TYPE_CHECKING:
    from pagedrs.config import EngineConfig
    from pagedrs.lora.manager import LoRAManager


def _run_eagerly(forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The CPU's stand-in for graph capture (tests): the forward itself, run at each replay."""
    return forward


def _on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """``device`` as the current CUDA device (nothing on a CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def load_model_runner(
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int,
    *,
    rank: int = 0,
    size: int = 1,
    hf_config: Any = None,
    graphs: GraphSettings | None = None,
    release_windows: bool = True,
) -> ModelRunner:
    """Builds this rank's shard of the model, reads its slices of the checkpoint, and sets up
    its KV cache (its KV heads of ``num_blocks`` blocks, laid out by `KVLayout.plan` with
    ``release_windows``)."""
    source = resolve_model(config.model)
    model = build_model(hf_config or load_config(source, config.hf_overrides), dtype, TensorParallel(rank, size))
    load_weights(model, source, config.quantization, device)  # packs linears where the weights call for it
    if config.cpu_activation_quantization == "int8" and use_int8_activations(model) == 0:
        raise ValueError(
            "cpu_activation_quantization='int8' needs packed Q8_0, Q4_0 or Q4_1 linears on the CPU "
            "(a GGUF file of those, or quantization='int8'); this model has none"
        )
    if device.type == "cpu":
        use_scales_first(model)  # the exact path's row order where this build reads it faster (AVX2)
    model = model.to(device).eval()
    layout = KVLayout.plan(model.layer_windows, release_windows)
    cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)
    return ModelRunner(
        model, num_blocks, config.block_size, dtype, device, config.attention_backend, graphs, layout, cache_dtype
    )


class ModelRunner:
    """Owns the model and its KV cache: ``layout.num_slots`` tensor pairs of ``[num_blocks,
    block_size, KVH, D]``, each layer reading one of them at its layer group's blocks
    (`pagedrs.engine.kv_layout`)."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str = "auto",
        graphs: GraphSettings | None = None,
        layout: KVLayout | None = None,
        cache_dtype: torch.dtype | None = None,
    ):
        """``graphs``: capture decode steps as CUDA graphs (`pagedrs.engine.cuda_graphs`) on
        the GPU backends; on a CPU (tests only) the same path runs eagerly. ``layout``: how the
        layers share the blocks (default: `KVLayout.plan` of the model's windows); it must be
        the scheduler's (its ``group_windows`` are the core's ``kv_group_windows``). ``cache_dtype``:
        the KV cache's (default: ``dtype``; a 16-bit one under a float32 model on the CPU)."""
        self.model = model
        self.layout = layout if layout is not None else KVLayout.plan(model.layer_windows)
        self.block_size = block_size
        self.device = device
        self.attention_backend: AttentionBackend = select_backend(
            attention_backend,
            device,
            model.head_dim,
            model.num_heads,
            model.num_kv_heads,
            block_size,
            dtype=dtype,
            softcap=model.softcap,
            sinks=model.attention_sinks,
        )
        """Builds each step's attention metadata and copies blocks; on the GPU kernels it holds
        their `KernelPlan` (which of CUDA and Triton runs decode and prefill)."""
        self.lora: LoRAManager | None = None
        """The engine's adapters, when it was built with ``enable_lora`` (set by the builder)."""
        self.cpu_stack: CpuDecoderStack | None = None
        """How the layers run: as one compiled call per step on the CPU where the stack takes
        the model (`pagedrs.models.cpu_stack`), else (``None``) as the model's Python layers."""
        if why_unsupported(model, device, self.attention_backend) is None:
            self.cpu_stack = CpuDecoderStack(model, self.layout.layer_views)
        self.inputs = StagedInputs(device)
        # NOTE: a captured step holds one metadata: models whose layers attend with more than
        # one view (window or layer group) run eagerly; so do mixtures of experts, whose grouped
        # matmuls size their launch by the step's routing (a host read a graph cannot replay).
        graphed = graphs is not None and self.attention_backend.graphable and len(self.layout.views) == 1
        graphed = graphed and not any(isinstance(layer.mlp, SparseMoe) for layer in model.decoder_layers())
        # With graphs, one block past the scheduler's takes the padding rows' keys/values.
        shape = (num_blocks + int(graphed), block_size, model.num_kv_heads, model.head_dim)
        cache_dtype = cache_dtype or dtype
        self.cache_slots = [
            self._cache_pair(shape, cache_dtype, model.latent_cache) for _ in range(self.layout.num_slots)
        ]
        """The cache tensors, ``layout.num_slots`` key/value pairs (a latent cache's pair is
        one tensor twice: `pagedrs.models.mla`)."""
        self.kv_caches = [self.cache_slots[slot] for slot in self.layout.layer_slots]
        """Each layer's key/value pair (layers of different groups share a pair)."""
        self.graphs: DecodeGraphs | None = None
        """Captured decode steps, when asked for and the GPU backend runs."""
        if graphs is not None and graphed:
            capture = capture_cuda_graph(torch.cuda.graph_pool_handle()) if device.type == "cuda" else _run_eagerly
            # The capture's streams and pool belong to the current device: make it the model's.
            with torch.inference_mode(), _on_device(device):
                self.graphs = DecodeGraphs(
                    model,
                    self.kv_caches,
                    self.attention_backend,
                    graphs,
                    block_size,
                    num_blocks=num_blocks,
                    sliding_window=self.layout.views[0][1],
                    capture=capture,
                )

    def _cache_pair(
        self, shape: tuple[int, ...], dtype: torch.dtype, latent: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.zeros(shape, dtype=dtype, device=self.device)
        return (keys, keys) if latent else (keys, torch.zeros(shape, dtype=dtype, device=self.device))

    @property
    def cache_bytes_per_block(self) -> int:
        """Bytes one block id takes in every cache tensor (a latent pair's one tensor once)."""
        distinct = {id(t): t for pair in self.cache_slots for t in pair}.values()
        return sum(t[0].numel() * t.element_size() for t in distinct)

    def expert_tokens(self) -> dict[int, torch.Tensor]:
        """(Token, slot) pairs routed to each expert of each mixture-of-experts layer since the
        model was built (int64 ``[E]`` copies, by layer index); empty for a dense model."""
        return {
            index: layer.mlp.expert_tokens.cpu().clone()
            for index, layer in enumerate(self.model.decoder_layers())
            if isinstance(layer.mlp, SparseMoe)
        }

    def execute(
        self,
        out: SchedulerOutput,
        extra_rows: np.ndarray | None = None,
        pool_rows: np.ndarray | None = None,
        sampled_rows: np.ndarray | None = None,
        lora_rows: np.ndarray | None = None,
    ) -> StepLogits:
        """Copy-on-write copies, then the forward pass. Returns float32 logits of the rows to
        sample (``out.logits_indices``, or those of them ``sampled_rows`` picks) and of
        ``extra_rows`` (prompt logprobs), and the final hidden states of the ``pool_rows``
        tokens (float32; pooling requests). (With tensor parallelism
        `pagedrs.engine.parallel.TensorParallelRunner` sends the step to the other ranks first.)"""
        arrays = StepArrays.of(out, extra_rows, sampled_rows, lora_rows)
        logits, pooled = self.forward_pooled(arrays, pool_rows)
        return StepLogits.split(logits, out, sampled_rows, pooled)

    def forward(self, out: StepArrays) -> torch.Tensor:
        """One step of this rank's shard; float32 logits of ``out.logits_rows`` (the whole
        vocabulary on rank 0)."""
        return self.forward_pooled(out)[0]

    def forward_pooled(
        self, out: StepArrays, pool_rows: np.ndarray | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, and the final hidden states (float32) of the ``pool_rows`` tokens when
        there are any (rank 0 only: the other ranks compute the same logits rows).
        ``out.lora_rows``: each token row's LoRA slot (-1: none) when some rows run adapters
        (`pagedrs.lora`): the compiled stack adds their updates where it runs, else the Python
        layers' hooks do (a captured graph has none: such steps run eagerly)."""
        adapters = self.lora is not None and bool((out.lora_rows >= 0).any())
        return self._forward(out, pool_rows, out.lora_rows if adapters else None)

    @contextlib.contextmanager
    def _step_adapters(self, stack: CpuDecoderStack | None, lora_rows: np.ndarray) -> Iterator[None]:
        """The step's rows-to-slots map, for whichever runs the layers (the compiled stack, or
        the Python layers' hooks), cleared afterwards."""
        if stack is not None:
            stack.set_lora_rows(torch.from_numpy(np.ascontiguousarray(lora_rows, dtype=np.int64)))
            try:
                yield
            finally:
                stack.set_lora_rows(None)
        else:
            assert self.lora is not None
            self.lora.set_step(lora_rows, self.device)
            try:
                yield
            finally:
                self.lora.set_step(None, self.device)

    @inference_mode
    def _forward(
        self, out: StepArrays, pool_rows: np.ndarray | None, lora_rows: np.ndarray | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pooling = pool_rows is not None and len(pool_rows) > 0
        adapters = lora_rows is not None
        graphs = self.graphs
        if (
            graphs is not None
            and not pooling
            and not adapters
            and graphs.can_run(out.query_start_loc, out.logits_rows, out.block_tables[0], len(out.block_copies))
        ):
            with _on_device(self.device):
                return graphs.run(
                    out.input_token_ids, out.positions, out.slot_mapping[0], out.context_lens, out.block_tables[0]
                ), None
        # Everything the step reads on the device goes over in one copy (on CUDA).
        with self.inputs.one_copy():
            # One metadata per attention view of the layers (one for most models).
            metas = [
                self.attention_backend.metadata.build(
                    positions=out.positions,
                    slot_mapping=out.slot_mapping[group],
                    query_start_loc=out.query_start_loc,
                    context_lens=out.context_lens,
                    block_tables=out.block_tables[group],
                    block_size=self.block_size,
                    sliding_window=window,
                    device=self.device,
                    upload=self.inputs.upload,
                )
                for group, window in self.layout.views
            ]
            rows = np.concatenate([out.logits_rows, pool_rows]) if pooling else out.logits_rows
            input_token_ids, positions, rows_on_device = self.inputs.upload(out.input_token_ids, out.positions, rows)
            lengths = None
            if self.model.length_dependent_rope:
                lengths = self.inputs.upload(rope_lengths(out.positions, out.query_start_loc, out.prompt_lens))[0]
            copies = self.inputs.upload(out.block_copies)[0] if len(out.block_copies) else None
        if copies is not None:
            self.attention_backend.copy_blocks(self.cache_slots, copies)
        meta = metas[0] if len(metas) == 1 else StepViews(metas, self.layout.layer_views)
        model = self.model
        num_logits = len(out.logits_rows)
        stack = self.cpu_stack if not adapters or (self.cpu_stack is not None and self.cpu_stack.has_lora) else None

        def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            if not pooling and num_logits:
                return model(input_token_ids, positions, self.kv_caches, meta, rows_on_device, stack, lengths), None
            hidden = model.final_hidden(
                input_token_ids, positions, self.kv_caches, meta, rows_on_device, stack, lengths
            )
            if num_logits:  # (a sequence classifier has no head: its steps have no rows to sample)
                logits = model.compute_logits(hidden[:num_logits])
            else:
                logits = torch.empty((0, model.config.vocab_size), dtype=torch.float32, device=self.device)
            return logits, hidden[num_logits:].float() if pooling else None

        if lora_rows is None:  # (no context manager on the common step: each costs microseconds, cold)
            return run()
        with self._step_adapters(stack, lora_rows):
            return run()
