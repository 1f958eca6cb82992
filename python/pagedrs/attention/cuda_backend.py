"""The GPU PagedAttention backend: the same contract as the torch reference
(`pagedrs.attention.torch_ref`), run by the CUDA kernels in ``cuda/`` or the Triton kernels
of `pagedrs.attention.triton_attention`, chosen per phase (`KernelPlan`).

Per step, `CudaAttentionMetadata.build` splits the scheduler's sequences into decodes (one
query row each) and prefill chunks (several rows, causal, over a cached prefix) and moves
their block tables and lengths (and, for a Triton launch, its query tiles) to the GPU once;
each layer then writes its new keys/values and runs at most two attention launches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedrs.attention import triton_attention
from pagedrs.attention.torch_ref import write_kv
from pagedrs.attention.triton_attention import TileConfig
from pagedrs.kernels import cuda as cuda_kernels

KERNELS = ("cuda", "triton")
"""The GPU kernels a `KernelPlan` picks from for each phase."""

CUDA_HEAD_SIZES = (64, 128)
CUDA_MAX_GROUP = 16


def cuda_supports(head_dim: int, num_heads: int, num_kv_heads: int) -> str | None:
    """Why the CUDA kernels cannot run this model's attention, or ``None`` if they can."""
    if head_dim not in CUDA_HEAD_SIZES:
        return f"head size {head_dim} (the kernels take {' and '.join(map(str, CUDA_HEAD_SIZES))})"
    if num_heads // num_kv_heads > CUDA_MAX_GROUP:
        return f"{num_heads // num_kv_heads} query heads per KV head (the kernels take at most {CUDA_MAX_GROUP})"
    return None


@dataclass(frozen=True)
class KernelPlan:
    """Which kernels run each phase of a step (``"cuda"`` or ``"triton"``), and the model's
    attention shape, which the Triton launches tile by."""

    decode: str
    prefill: str
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def uses(self, kernel: str) -> bool:
        return kernel in (self.decode, self.prefill)

    def tile_config(self, decode: bool) -> TileConfig:
        return triton_attention.tile_config(self.num_heads // self.num_kv_heads, self.head_dim, decode)

    def build(self, **step: Any) -> CudaAttentionMetadata:
        """`CudaAttentionMetadata.build` under this plan (the runner's metadata class)."""
        return CudaAttentionMetadata.build(**step, plan=self)


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
    triton: _TritonLaunch | None = None
    """How the Triton kernel tiles this launch (``None``: the CUDA kernel runs it)."""


@dataclass
class _TritonLaunch:
    config: TileConfig
    tile_seqs: torch.Tensor
    """``int32 [num_tiles]``"""
    tile_rows: torch.Tensor
    """``int32 [num_tiles]``"""
    num_segments: int


def _group_arrays(
    seqs: np.ndarray,
    query_start_loc: np.ndarray,
    context_lens: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    num_tokens: int,
) -> tuple[list[np.ndarray], int, int] | None:
    """``([rows (omitted when the group is every row in order), block tables, cu_seqlens_q,
    context lens], max_context_len, num_rows)`` of one launch's sequences, on the host."""
    if len(seqs) == 0:
        return None
    starts, ends = query_start_loc[seqs], query_start_loc[seqs + 1]
    lengths = ends - starts
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    contexts = context_lens[seqs].astype(np.int32)
    max_context = int(contexts.max())
    width = max(-(-max_context // block_size), 1)
    arrays = [np.ascontiguousarray(block_tables[seqs, :width], dtype=np.int32), cu, contexts]
    if int(cu[-1]) != num_tokens:  # not every row of the step in order: the rows are gathered
        arrays.insert(0, np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)]).astype(np.int64))
    return arrays, max_context, int(cu[-1])


def _group(
    arrays: list[torch.Tensor], max_context_len: int, num_rows: int, tiling: tuple[TileConfig, int] | None
) -> _Group:
    """The launch from its uploaded arrays: ``[rows?, block tables, cu_seqlens_q, context
    lens]``, then ``[tile_seqs, tile_rows]`` when Triton runs it (``tiling``: its tile config
    and split-K parts)."""
    triton = None
    if tiling is not None:
        triton = _TritonLaunch(tiling[0], arrays[-2], arrays[-1], tiling[1])
        arrays = arrays[:-2]
    rows = arrays[0] if len(arrays) == 4 else None
    block_tables, cu_seqlens_q, context_lens = arrays[-3:]
    return _Group(
        rows=rows,
        block_tables=block_tables,
        cu_seqlens_q=cu_seqlens_q,
        context_lens=context_lens,
        max_context_len=max_context_len,
        num_rows=num_rows,
        triton=triton,
    )


@dataclass
class CudaAttentionMetadata:
    slot_mapping: torch.Tensor
    decodes: _Group | None
    prefills: _Group | None
    sliding_window: int
    cuda_writes: bool = True
    """Whether the CUDA extension writes the keys/values (else torch's ``index_copy_``: a
    Triton-only plan needs no nvcc)."""

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
        upload: Callable[..., list[torch.Tensor]] | None = None,
        plan: KernelPlan | None = None,
    ) -> CudaAttentionMetadata:
        """``plan``: which kernels run each phase (default: the CUDA kernels for both)."""
        del positions  # each row's position is implied: the chunk ends the context
        upload = upload or (lambda *arrays: [torch.from_numpy(array).to(device) for array in arrays])
        query_lens = np.diff(query_start_loc) if len(query_start_loc) else np.zeros(0, np.int32)
        num_tokens = int(query_start_loc[-1]) if len(query_start_loc) else 0
        args = (query_start_loc, context_lens, block_tables, block_size, num_tokens)
        groups = []
        tilings: list[tuple[TileConfig, int] | None] = []
        for decode in (True, False):
            group = _group_arrays(np.nonzero((query_lens == 1) if decode else (query_lens > 1))[0], *args)
            tiling = None
            if group is not None and plan is not None and (plan.decode if decode else plan.prefill) == "triton":
                arrays, max_context_len, _ = group
                config = plan.tile_config(decode)
                tile_seqs, tile_rows = triton_attention.query_tiles(arrays[-2], config.tile_tokens)
                segments = triton_attention.num_segments_for(
                    len(tile_seqs), plan.num_kv_heads, max_context_len, config.block_n
                )
                arrays.extend((tile_seqs, tile_rows))
                tiling = (config, segments)
            groups.append(group)
            tilings.append(tiling)
        # Every array of the step in one upload (one copy when the runner stages its inputs).
        tensors = upload(slot_mapping, *(array for group in groups if group is not None for array in group[0]))
        slot_mapping_tensor, rest = tensors[0], tensors[1:]
        built: list[_Group | None] = []
        for group, tiling in zip(groups, tilings):
            if group is None:
                built.append(None)
                continue
            arrays, max_context_len, num_rows = group
            built.append(_group(rest[: len(arrays)], max_context_len, num_rows, tiling))
            rest = rest[len(arrays) :]
        return cls(
            slot_mapping=slot_mapping_tensor,
            decodes=built[0],
            prefills=built[1],
            sliding_window=sliding_window or 0,
            cuda_writes=plan is None or plan.uses("cuda"),
        )

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Writes this step's keys/values, then attends every query row (``[T, H, D]``).
        ``softcap`` (Gemma 2) runs on the Triton kernels only (`select_backend` plans them);
        ``sinks`` (gpt-oss) on none of them (`select_backend` picks the reference)."""
        if sinks is not None:
            raise ValueError("the GPU attention kernels have no attention sinks: use attention_backend='torch'")
        if self.cuda_writes:
            cuda_kernels.load().reshape_and_cache(key, value, key_cache, value_cache, self.slot_mapping)
        else:
            write_kv(key, value, key_cache, value_cache, self.slot_mapping)
        query = query.contiguous()
        out = torch.empty_like(query)
        for group, decode in ((self.decodes, True), (self.prefills, False)):
            if group is None:
                continue
            q = query if group.rows is None else query.index_select(0, group.rows)
            o = out if group.rows is None else torch.empty_like(q)
            if group.triton is not None:
                launch = group.triton
                triton_attention.paged_attention(
                    o,
                    q,
                    key_cache,
                    value_cache,
                    group.block_tables,
                    group.cu_seqlens_q,
                    group.context_lens,
                    launch.tile_seqs,
                    launch.tile_rows,
                    scale,
                    self.sliding_window,
                    launch.config,
                    launch.num_segments,
                    softcap or 0.0,
                )
            elif softcap:
                raise ValueError("the CUDA attention kernels have no softcap: use attention_backend='triton'")
            elif decode:
                cuda_kernels.load().paged_attention(
                    o,
                    q,
                    key_cache,
                    value_cache,
                    group.block_tables,
                    group.context_lens,
                    group.max_context_len,
                    scale,
                    self.sliding_window,
                )
            else:
                cuda_kernels.load().paged_prefill_attention(
                    o,
                    q,
                    key_cache,
                    value_cache,
                    group.block_tables,
                    group.cu_seqlens_q,
                    group.context_lens,
                    group.max_context_len,
                    scale,
                    self.sliding_window,
                )
            if group.rows is not None:
                out.index_copy_(0, group.rows, o)
        return out
