"""The CPU PagedAttention backend: the same contract as the torch reference
(`pagedrs.attention.torch_ref`), run by the compiled kernel in ``cpu/`` and, for long prefill
chunks, by torch's ``scaled_dot_product_attention``.

The reference gathers every decode's whole blocks, padded to the longest context, and
attends over the padding; here a step costs what its sequences' own tokens cost:

- decodes and short chunks (fewer than `SDPA_MIN_ROWS` rows): the kernel, one call per layer,
  reading each key and value row in place through the block table;
- each longer prefill chunk: its own blocks gathered, then ``scaled_dot_product_attention``
  with a causal mask aligned to the chunk's end (and the sliding window).

NOTE: the split is measured (``benches/bench_cpu_attention.py``, SmolLM2's shapes, 2 cores):
torch's flash kernel is GEMM-shaped and beats the kernel's rows on long chunks (a 512-token
prompt 4.2 against 5.4 ms, a 256-token chunk after 768 cached tokens 4.5 against 9.1 ms, four
32-row chunks 1.9 against 3.0 ms); at 16 rows the two are even from run to run, below that its
fixed cost loses, and decodes are what the kernel is for (batch 64 at context ~500: 2.9 ms
against the reference's 16 ms).

Per step, `CpuAttentionMetadata.build` turns the scheduler's arrays into tensors once; each
layer then writes its new keys/values by slot mapping, and only then attends (the NOTE in the
Rust ``batch.rs``: a sequence may read blocks another sequence of the same batch writes this
step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedrs.attention.torch_ref import attend_gathered, write_kv
from pagedrs.kernels import cpu as cpu_kernels

SDPA_MIN_ROWS = 32
"""Prefill chunks with at least this many rows go through scaled_dot_product_attention."""


@dataclass
class _KernelRows:
    """The sequences the kernel attends, in one call."""

    rows: torch.Tensor | None
    """Their query rows in the step, in order (``None``: all rows of the step). ``long [R]``"""
    block_tables: torch.Tensor
    """``int32 [S, W]``, W at least as wide as the longest of their contexts needs"""
    cu_seqlens_q: torch.Tensor
    """Rows of sequence s are ``cu_seqlens_q[s] .. cu_seqlens_q[s + 1]`` of ``rows``. ``int32 [S + 1]``"""
    context_lens: torch.Tensor
    """Tokens each attends to, this step's included. ``int32 [S]``"""


@dataclass
class _SdpaChunk:
    """One long prefill chunk: rows ``start .. end`` of the step."""

    start: int
    end: int
    blocks: torch.Tensor
    """Its sequence's blocks, in order, from the first one its first row's window reaches
    (the first block without a window). ``long [W]``"""
    context_len: int
    mask: torch.Tensor | None
    """Which of the keys from ``blocks``' first on each row sees (``bool [L, C]``, ``C`` keys:
    up to ``context_len``); ``None`` for a whole prompt without a window (plain causal)."""

    @property
    def num_keys(self) -> int:
        """Keys gathered: from the start of ``blocks`` to the end of the context."""
        return self.context_len if self.mask is None else int(self.mask.shape[1])


@dataclass
class CpuAttentionMetadata:
    """The step's attention layout, shared by every layer."""

    slot_mapping: torch.Tensor
    """Slot each new key/value is written to. ``long [T]``"""
    kernel: _KernelRows | None
    sdpa_chunks: list[_SdpaChunk]
    sliding_window: int
    """Keys a query sees, its own included; 0 for all of them."""

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
    ) -> CpuAttentionMetadata:
        del upload  # on the CPU the arrays are wrapped, never copied
        del positions  # each row's position is implied: a sequence's rows end its context
        if device.type != "cpu":
            raise ValueError(f"the CPU attention backend runs on the CPU, not on {device}")
        slots = torch.from_numpy(np.ascontiguousarray(slot_mapping, dtype=np.int64))
        if len(query_start_loc) > 1 and query_start_loc[-1] < SDPA_MIN_ROWS:
            # No chunk can be long: every row goes to the kernel, which takes the scheduler's
            # arrays as they are (a table wider than its contexts need included).
            # NOTE: a decode step's case; the general path below cost ~50 us more of numpy calls
            # there, each run cold after the step's weights streamed through the caches.
            kernel = _KernelRows(
                rows=None,
                block_tables=torch.from_numpy(np.ascontiguousarray(block_tables, dtype=np.int32)),
                cu_seqlens_q=torch.from_numpy(np.ascontiguousarray(query_start_loc, dtype=np.int32)),
                context_lens=torch.from_numpy(np.ascontiguousarray(context_lens, dtype=np.int32)),
            )
            return cls(slot_mapping=slots, kernel=kernel, sdpa_chunks=[], sliding_window=sliding_window or 0)
        query_lens = np.diff(query_start_loc) if len(query_start_loc) else np.zeros(0, np.int32)
        long_chunk = query_lens >= SDPA_MIN_ROWS
        return cls(
            slot_mapping=slots,
            kernel=_kernel_rows(np.nonzero(~long_chunk)[0], query_start_loc, context_lens, block_tables, block_size),
            sdpa_chunks=[
                _sdpa_chunk(
                    int(query_start_loc[seq]),
                    int(query_start_loc[seq + 1]),
                    int(context_lens[seq]),
                    block_tables[seq],
                    block_size,
                    sliding_window,
                )
                for seq in np.nonzero(long_chunk)[0]
            ],
            sliding_window=sliding_window or 0,
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
        """Writes this step's ``key``/``value`` (``[T, KVH, D]``) into the caches, then attends
        every query row (``[T, H, D]``) over its sequence's paged context. Returns ``[T, H, D]``.
        ``softcap``: scores become ``softcap * tanh(score / softcap)`` (Gemma 2); ``sinks``
        (float32 ``[H]``): a logit per head in the softmax with no value (gpt-oss)."""
        write_kv(key, value, key_cache, value_cache, self.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype)
        if self.kernel is not None:
            self._attend_kernel(self.kernel, query, key_cache, value_cache, scale, softcap or 0.0, sinks, out)
        for chunk in self.sdpa_chunks:
            _attend_sdpa(chunk, query, key_cache, value_cache, scale, softcap, sinks, out)
        return out

    def _attend_kernel(
        self,
        group: _KernelRows,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
        softcap: float,
        sinks: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        q = query if group.rows is None else query.index_select(0, group.rows)
        o = out if group.rows is None else torch.empty(q.shape, dtype=q.dtype)
        cpu_kernels.load().paged_attention(
            o,
            q,
            key_cache,
            value_cache,
            group.block_tables,
            group.cu_seqlens_q,
            group.context_lens,
            scale,
            self.sliding_window,
            softcap,
            None if sinks is None else sinks.float().contiguous(),
        )
        if group.rows is not None:
            out.index_copy_(0, group.rows, o)


def _kernel_rows(
    seqs: np.ndarray, query_start_loc: np.ndarray, context_lens: np.ndarray, block_tables: np.ndarray, block_size: int
) -> _KernelRows | None:
    if len(seqs) == 0:
        return None
    starts, ends = query_start_loc[seqs], query_start_loc[seqs + 1]
    cu_seqlens_q = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(ends - starts, out=cu_seqlens_q[1:])
    contexts = np.ascontiguousarray(context_lens[seqs], dtype=np.int32)
    width = -(-int(contexts.max()) // block_size)
    all_rows = len(seqs) == len(query_start_loc) - 1  # every sequence, so every row in order
    rows = None if all_rows else torch.from_numpy(np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)]))
    return _KernelRows(
        rows=rows,
        block_tables=torch.from_numpy(np.ascontiguousarray(block_tables[seqs, :width], dtype=np.int32)),
        cu_seqlens_q=torch.from_numpy(cu_seqlens_q),
        context_lens=torch.from_numpy(contexts),
    )


def _sdpa_chunk(
    start: int, end: int, context_len: int, block_table: np.ndarray, block_size: int, sliding_window: int | None
) -> _SdpaChunk:
    num_blocks = -(-context_len // block_size)
    first_row = context_len - (end - start)
    # A window hides every block before its first row's: they are not gathered (a sliding
    # KV layer group may have released them).
    first_block = 0 if sliding_window is None else max(0, first_row + 1 - sliding_window) // block_size
    mask = None
    if context_len != end - start or sliding_window is not None:
        query_positions = np.arange(first_row, context_len)[:, None]
        keys = np.arange(first_block * block_size, context_len)[None, :]
        visible = keys <= query_positions
        if sliding_window is not None:
            visible &= keys > query_positions - sliding_window
        mask = torch.from_numpy(visible)
    return _SdpaChunk(
        start=start,
        end=end,
        blocks=torch.from_numpy(block_table[first_block:num_blocks].astype(np.int64)),
        context_len=context_len,
        mask=mask,
    )


def _attend_sdpa(
    chunk: _SdpaChunk,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """One chunk's rows over its own gathered context; grouped-query attention by viewing the
    query heads as ``[KVH, group]`` against keys broadcast over the group (no repeat). SDPA
    has no softcap and no sinks: such a chunk goes through the reference's attention instead."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    num_rows, num_heads = chunk.end - chunk.start, query.shape[1]
    if softcap or sinks is not None:
        keys = _as_float(key_cache[chunk.blocks], query.dtype).flatten(0, 1)[: chunk.num_keys]
        values = _as_float(value_cache[chunk.blocks], query.dtype).flatten(0, 1)[: chunk.num_keys]
        mask = chunk.mask
        if mask is None:
            mask = torch.ones(num_rows, chunk.context_len, dtype=torch.bool).tril(chunk.context_len - num_rows)
        out[chunk.start : chunk.end] = attend_gathered(
            query[chunk.start : chunk.end].unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            mask.unsqueeze(0),
            scale,
            softcap,
            sinks,
        ).squeeze(0)
        return
    # [L, H, D] -> [KVH, group, L, D]; keys and values [C, KVH, D] -> [KVH, 1, C, D].
    q = query[chunk.start : chunk.end].transpose(0, 1).unflatten(0, (num_kv_heads, num_heads // num_kv_heads))
    # A 16-bit or fp8 cache under float32 queries: the gathered rows as float32.
    keys = _as_float(key_cache[chunk.blocks], query.dtype).flatten(0, 1)[: chunk.num_keys].transpose(0, 1).unsqueeze(1)
    values = _as_float(value_cache[chunk.blocks], query.dtype).flatten(0, 1)[: chunk.num_keys]
    values = values.transpose(0, 1).unsqueeze(1)
    attended = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale
    )
    out[chunk.start : chunk.end] = attended.flatten(0, 1).transpose(0, 1).reshape(num_rows, num_heads, head_dim)


def _as_float(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows in the queries' dtype; an fp8 cache's through the kernel's conversion
    (torch's own converts one element at a time: 30 times bfloat16's cost)."""
    if rows.dtype == torch.float8_e4m3fn:
        return cpu_kernels.load().fp8_as_float(rows)
    return rows.to(dtype)
