"""`StepArrays`: what one forward pass reads, as flat arrays (rank 0 sends exactly these to the
other tensor-parallel ranks)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

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

    @staticmethod
    def of(out: SchedulerOutput, extra_rows: np.ndarray | None = None) -> StepArrays:
        rows = out.logits_indices
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
        )
