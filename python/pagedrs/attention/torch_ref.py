"""The torch reference PagedAttention backend: correct for every batch the scheduler builds
(prefill chunks over a cached prefix, decodes, both mixed), on CPU or GPU, and the oracle
for the CUDA kernels.

Per step, `AttentionMetadata.build` turns the scheduler's arrays into gather indices and
masks once; every layer then (1) writes the step's new keys/values into its cache by slot
mapping, and only then (2) attends, so a sequence may read blocks another sequence of the
same batch is writing this step (see the NOTE in the Rust `batch.rs`).

Shapes: ``num_tokens`` (T) rows this step, ``num_heads`` (H), ``num_kv_heads`` (KVH),
``head_dim`` (D); the cache of one layer is ``[num_blocks, block_size, KVH, D]``.
Decodes (one query each) are batched together; each prefill chunk is attended on its own
(a Python loop per prefill sequence, never per token).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PrefillChunk:
    """One sequence computing more than one token this step."""

    start: int
    """First row of its queries in the step's token dimension."""
    end: int
    """One past its last row."""
    blocks: torch.Tensor
    """Its blocks, in order. ``long [W]``"""
    mask: torch.Tensor
    """Which context positions (``W * block_size`` of them) each query attends to.
    ``bool [L, W * block_size]``"""


@dataclass
class AttentionMetadata:
    """The step's attention layout, shared by every layer."""

    slot_mapping: torch.Tensor
    """Slot each new key/value is written to. ``long [T]``"""
    decode_rows: torch.Tensor
    """Rows of the decode queries. ``long [Sd]``"""
    decode_blocks: torch.Tensor
    """Block tables of the decodes, zero-padded. ``long [Sd, Wd]``"""
    decode_mask: torch.Tensor
    """Valid context positions of each decode. ``bool [Sd, Wd * block_size]``"""
    prefills: list[PrefillChunk]

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
    ) -> AttentionMetadata:
        del upload  # the reference uploads its own arrays (it is the oracle, not the fast path)
        query_lens = np.diff(query_start_loc) if len(query_start_loc) else np.zeros(0, np.int32)
        is_decode = query_lens == 1
        # NOTE: keys and values are gathered whole blocks at a time (a block is one
        # contiguous chunk of the cache); positions past a context are masked out.
        decode_seqs = np.nonzero(is_decode)[0]
        num_blocks = -(-context_lens[decode_seqs] // block_size) if len(decode_seqs) else np.zeros(0, np.int64)
        width = int(num_blocks.max()) if len(decode_seqs) else 0
        decode_blocks = block_tables[decode_seqs][:, :width].astype(np.int64)
        offsets = np.arange(width * block_size)[None, :]
        decode_positions = positions[query_start_loc[decode_seqs]][:, None]
        decode_mask = offsets < context_lens[decode_seqs][:, None]
        if sliding_window is not None:
            decode_mask &= offsets > decode_positions - sliding_window

        prefills = []
        for seq in np.nonzero(~is_decode)[0]:
            start, end = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
            context = int(context_lens[seq])
            seq_blocks = -(-context // block_size)
            query_positions = positions[start:end][:, None]
            keys = np.arange(seq_blocks * block_size)[None, :]
            mask = (keys <= query_positions) & (keys < context)
            if sliding_window is not None:
                mask &= keys > query_positions - sliding_window
            prefills.append(
                PrefillChunk(
                    start=start,
                    end=end,
                    blocks=torch.from_numpy(block_tables[seq, :seq_blocks].astype(np.int64)).to(device),
                    mask=torch.from_numpy(mask).to(device),
                )
            )
        return cls(
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            decode_rows=torch.from_numpy(query_start_loc[decode_seqs].astype(np.int64)).to(device),
            decode_blocks=torch.from_numpy(decode_blocks).to(device),
            decode_mask=torch.from_numpy(decode_mask).to(device),
            prefills=prefills,
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
        """`paged_attention` with this step's layout (the interface every backend's
        metadata offers the model). ``softcap``: scores become ``softcap * tanh(score /
        softcap)`` before the softmax (Gemma 2); ``sinks`` (``[H]``): a logit per head that joins
        the softmax with no value (gpt-oss)."""
        return paged_attention(query, key, value, key_cache, value_cache, self, scale, softcap, sinks)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes ``[T, KVH, D]`` keys/values into ``[num_blocks, block_size, KVH, D]`` caches
    (rounded to the caches' dtype where it differs: a 16-bit or fp8 cache of a float32 model; an
    fp8 cache's rows clamped to e4m3's largest value first, scale 1.0, as the compiled decoder
    stack stores them)."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    for rows, cache in ((key, key_cache), (value, value_cache)):
        if cache.dtype == torch.float8_e4m3fn:
            largest = torch.finfo(torch.float8_e4m3fn).max
            # torch's CPU index_copy_ has no fp8: the bytes are copied.
            rows, cache = rows.clamp(-largest, largest).to(cache.dtype).view(torch.uint8), cache.view(torch.uint8)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, rows.to(cache.dtype))


def attend_gathered(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query attention of ``[B, L, H, D]`` queries over ``[B, C, KVH, D]`` keys and
    values with a ``[B, L, C]`` mask; softmax in float32, over one more logit per head where
    ``sinks`` (``[H]``) are given (its probability goes to no value). Returns ``[B, L, H, D]``."""
    batch, length, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[2]
    group = num_heads // num_kv_heads
    q = query.reshape(batch, length, num_kv_heads, group, head_dim)
    scores = torch.einsum("blkgd,bckd->bkglc", q.float(), keys.float()) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[:, None, None, :, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, num_kv_heads, group, 1, 1).expand(batch, -1, -1, length, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkglc,bckd->blkgd", probs, values.float())
    return out.reshape(batch, length, num_heads, head_dim).to(query.dtype)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Writes this step's ``key``/``value`` (``[T, KVH, D]``) into the caches, then attends
    every query (``[T, H, D]``) over its sequence's paged context. Returns ``[T, H, D]``."""
    write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    out = torch.empty_like(query)

    def context(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """``[..., W]`` block ids -> ``[..., W * block_size, KVH, D]`` keys or values."""
        gathered = cache[blocks]
        return gathered.reshape(*blocks.shape[:-1], -1, num_kv_heads, head_dim)

    if len(meta.decode_rows):
        out[meta.decode_rows] = attend_gathered(
            query[meta.decode_rows].unsqueeze(1),
            context(key_cache, meta.decode_blocks),
            context(value_cache, meta.decode_blocks),
            meta.decode_mask.unsqueeze(1),
            scale,
            softcap,
            sinks,
        ).squeeze(1)
    for chunk in meta.prefills:
        out[chunk.start : chunk.end] = attend_gathered(
            query[chunk.start : chunk.end].unsqueeze(0),
            context(key_cache, chunk.blocks).unsqueeze(0),
            context(value_cache, chunk.blocks).unsqueeze(0),
            chunk.mask.unsqueeze(0),
            scale,
            softcap,
            sinks,
        ).squeeze(0)
    return out
