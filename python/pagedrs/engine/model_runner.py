"""Runs one scheduled batch through the model on the paged KV cache."""

from __future__ import annotations

import numpy as np
import torch

from pagedrs._core import SchedulerOutput
from pagedrs.attention import metadata_class, select_backend
from pagedrs.engine.staging import StagedInputs
from pagedrs.models.llama import LlamaFamilyForCausalLM


class ModelRunner:
    """Owns the model and its per-layer KV caches (``[num_blocks, block_size, KVH, D]``)."""

    def __init__(
        self,
        model: LlamaFamilyForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str = "auto",
    ):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.attention_backend = select_backend(
            attention_backend, device, model.head_dim, model.num_heads, model.num_kv_heads
        )
        self._metadata = metadata_class(self.attention_backend)
        if self.attention_backend == "cuda":
            from pagedrs.attention.cuda_ops import load

            load()  # build the kernels now, not in the first request's step
        self.inputs = StagedInputs(device)
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in model.layers
        ]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, extra_rows: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy-on-write copies, then the forward pass. Returns float32 logits of the rows to
        sample (``[len(out.logits_indices), vocab]``) and of ``extra_rows`` (prompt
        logprobs)."""
        rows = out.logits_indices
        if extra_rows is not None and len(extra_rows):
            rows = np.concatenate([rows, extra_rows.astype(np.int64)])
        # Everything the step reads on the device goes over in one copy (on CUDA).
        with self.inputs.one_copy():
            meta = self._metadata.build(
                positions=out.positions,
                slot_mapping=out.slot_mapping,
                query_start_loc=out.query_start_loc,
                context_lens=out.context_lens,
                block_tables=out.block_tables,
                block_size=self.block_size,
                sliding_window=self.model.sliding_window,
                device=self.device,
                upload=self.inputs.upload,
            )
            input_token_ids, positions, logits_rows = self.inputs.upload(out.input_token_ids, out.positions, rows)
            copies = self.inputs.upload(out.block_copies)[0] if len(out.block_copies) else None
        if copies is not None:
            if self.attention_backend == "cuda":
                from pagedrs.attention.cuda_backend import copy_blocks

                copy_blocks(self.kv_caches, copies)
            else:
                for key_cache, value_cache in self.kv_caches:
                    key_cache[copies[:, 1]] = key_cache[copies[:, 0]]
                    value_cache[copies[:, 1]] = value_cache[copies[:, 0]]
        logits = self.model(input_token_ids, positions, self.kv_caches, meta, logits_rows)
        num_sampled = len(out.logits_indices)
        return logits[:num_sampled], logits[num_sampled:]
