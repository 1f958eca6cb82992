"""The CUDA PagedAttention backend: the same contract as the torch reference
(`pagedrs.attention.torch_ref`), run by the kernels in ``cuda/``.

Per step, `CudaAttentionMetadata.build` splits the scheduler's sequences into decodes (one
query row each) and prefill chunks (several rows, causal, over a cached prefix) and moves
their block tables and lengths to the GPU once; each layer then writes its new keys/values
(``reshape_and_cache``) and runs at most two attention launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class _Group:
    """Sequences attended by one kernel launch."""

    rows: torch.Tensor | None
    """Their query rows in the step, in order (``None``: all rows, in order). ``long [R]``"""
    block_tables: torch.Tensor
    """``int32 [S, W]``"""
    cu_seqlens_q: torch.Tensor
    """``int32 [S + 1]``, relative to ``rows``"""
    context_lens: torch.Tensor
    """``int32 [S]``"""
    max_context_len: int
    num_rows: int


def _group(seqs: np.ndarray, query_start_loc: np.ndarray, context_lens: np.ndarray, block_tables: np.ndarray,
           block_size: int, num_tokens: int, device: torch.device) -> _Group | None:
    if len(seqs) == 0:
        return None
    starts, ends = query_start_loc[seqs], query_start_loc[seqs + 1]
    lengths = ends - starts
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    contexts = context_lens[seqs].astype(np.int32)
    max_context = int(contexts.max())
    width = max(-(-max_context // block_size), 1)
    all_rows = int(cu[-1]) == num_tokens  # every row of the step, in order: no gather needed
    rows = None if all_rows else torch.from_numpy(np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)]).astype(np.int64)).to(device)
    return _Group(
        rows=rows,
        block_tables=torch.from_numpy(np.ascontiguousarray(block_tables[seqs, :width], dtype=np.int32)).to(device),
        cu_seqlens_q=torch.from_numpy(cu).to(device),
        context_lens=torch.from_numpy(contexts).to(device),
        max_context_len=max_context,
        num_rows=int(cu[-1]),
    )


@dataclass
class CudaAttentionMetadata:
    slot_mapping: torch.Tensor
    decodes: _Group | None
    prefills: _Group | None
    sliding_window: int

    @classmethod
    def build(
        cls,
        *,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        query_start_loc: np.ndarray,
        context_lens: np.ndarray,
        block_tables: np.ndarray,
        block_size: int,
        sliding_window: int | None,
        device: torch.device,
    ) -> CudaAttentionMetadata:
        del positions  # each row's position is implied: the chunk ends the context
        query_lens = np.diff(query_start_loc) if len(query_start_loc) else np.zeros(0, np.int32)
        num_tokens = int(query_start_loc[-1]) if len(query_start_loc) else 0
        args = (query_start_loc, context_lens, block_tables, block_size, num_tokens, device)
        return cls(
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            decodes=_group(np.nonzero(query_lens == 1)[0], *args),
            prefills=_group(np.nonzero(query_lens > 1)[0], *args),
            sliding_window=sliding_window or 0,
        )

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Writes this step's keys/values, then attends every query row (``[T, H, D]``)."""
        from pagedrs.attention.cuda_ops import load

        ops = load()
        ops.reshape_and_cache(key, value, key_cache, value_cache, self.slot_mapping)
        query = query.contiguous()
        out = torch.empty_like(query)
        for group, decode in ((self.decodes, True), (self.prefills, False)):
            if group is None:
                continue
            q = query if group.rows is None else query.index_select(0, group.rows)
            o = out if group.rows is None else torch.empty_like(q)
            if decode:
                ops.paged_attention(o, q, key_cache, value_cache, group.block_tables, group.context_lens,
                                    group.max_context_len, scale, self.sliding_window)
            else:
                ops.paged_prefill_attention(o, q, key_cache, value_cache, group.block_tables, group.cu_seqlens_q,
                                            group.context_lens, group.max_context_len, scale, self.sliding_window)
            if group.rows is not None:
                out.index_copy_(0, group.rows, o)
        return out


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_copies: torch.Tensor) -> None:
    from pagedrs.attention.cuda_ops import load

    ops = load()
    for key_cache, value_cache in kv_caches:
        ops.copy_blocks(key_cache, value_cache, block_copies)
