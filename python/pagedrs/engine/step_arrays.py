"""`StepArrays`: what one forward pass reads, as flat arrays (rank 0 sends exactly these to the
other tensor-parallel ranks); `StepLogits`: what a runner's ``execute`` gives back."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from pagedrs._core import SchedulerOutput


class StepArrays(NamedTuple):
    """What a forward pass reads: `SchedulerOutput`'s arrays (see there), plus the rows whose
    logits are wanted. Tensor-parallel rank 0 sends exactly these to the other ranks."""

    input_token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    context_lens: np.ndarray
    prompt_lens: np.ndarray
    block_tables: np.ndarray
    logits_rows: np.ndarray
    """Rows to sample from, then rows for prompt logprobs."""
    block_copies: np.ndarray
    lora_rows: np.ndarray = np.zeros(0, np.int64)
    """Each token row's LoRA slot (-1: none) when some rows run adapters, else empty."""

    @staticmethod
    def of(
        out: SchedulerOutput,
        extra_rows: np.ndarray | None = None,
        sampled_rows: np.ndarray | None = None,
        lora_rows: np.ndarray | None = None,
    ) -> StepArrays:
        """``sampled_rows``: which of ``out``'s logits rows to compute (default: all; a pooling
        request's row is never sampled), then ``extra_rows``."""
        rows = out.logits_indices if sampled_rows is None else out.logits_indices[sampled_rows]
        if extra_rows is not None and len(extra_rows):
            rows = np.concatenate([rows, extra_rows.astype(np.int64)])
        return StepArrays(
            out.input_token_ids,
            out.positions,
            out.slot_mapping,
            out.query_start_loc,
            out.context_lens,
            out.prompt_lens,
            out.block_tables,
            rows,
            out.block_copies,
            np.zeros(0, np.int64) if lora_rows is None else np.asarray(lora_rows, np.int64),
        )


class StepLogits(NamedTuple):
    """What a runner's `execute` returns."""

    logits: torch.Tensor
    """Float32 logits of the rows to sample."""
    prompt_logits: torch.Tensor | None
    """Float32 logits of the prompt-logprob rows (``None``: there are none)."""
    pooled: torch.Tensor | None
    """Float32 final hidden states of the pooled token rows (``None``: none asked for)."""

    @staticmethod
    def split(
        logits: torch.Tensor, out: SchedulerOutput, sampled_rows: np.ndarray | None, pooled: torch.Tensor | None
    ) -> StepLogits:
        num_sampled = len(out.logits_indices) if sampled_rows is None else len(sampled_rows)
        if num_sampled == len(logits):  # no slicing ops: each costs ~20 us cold in a decode step
            return StepLogits(logits, None, pooled)
        return StepLogits(logits[:num_sampled], logits[num_sampled:], pooled)
