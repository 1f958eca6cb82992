"""Scheduler-shaped attention steps on random inputs: sequences scattered over a shuffled block
pool.
- `Batch`: a step with the torch reference's answer, for the kernel tests (CUDA and Triton).
- `make_step`: a step's arrays, tensors and caches, for the CPU backend (and its bench).
- `mixed_step`: fixed `build` arguments of a small mixed step on the CPU."""

from __future__ import annotations

import math

import numpy as np
import torch

from pagedrs.attention.torch_ref import AttentionMetadata


class Batch:
    """A scheduler-shaped step: sequences with context lengths, the last `query_lens` tokens of
    each computed this step, scattered over a shuffled block pool."""

    def __init__(
        self, context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, device="cuda"
    ):
        gen = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        self.block_size, self.dtype, self.device = block_size, dtype, torch.device(device)
        blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
        num_blocks = sum(blocks_per_seq) + 5
        pool = rng.permutation(num_blocks)
        width = max(blocks_per_seq)
        self.block_tables = np.zeros((len(context_lens), width), dtype=np.int32)
        used = 0
        for s, n in enumerate(blocks_per_seq):
            self.block_tables[s, :n] = pool[used : used + n]
            used += n
        self.context_lens = np.asarray(context_lens, dtype=np.int32)
        self.query_start_loc = np.zeros(len(context_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=self.query_start_loc[1:])
        positions, slots = [], []
        for s, (c, q) in enumerate(zip(context_lens, query_lens)):
            for p in range(c - q, c):
                positions.append(p)
                slots.append(int(self.block_tables[s, p // block_size]) * block_size + p % block_size)
        self.positions = np.asarray(positions, dtype=np.int64)
        self.slot_mapping = np.asarray(slots, dtype=np.int64)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        rows = len(positions)

        def rand(*size):
            return torch.randn(*size, generator=gen).to(dtype).to(self.device)

        self.key_cache, self.value_cache = rand(*shape), rand(*shape)
        self.query = rand(rows, num_heads, head_dim)
        self.key, self.value = rand(rows, num_kv_heads, head_dim), rand(rows, num_kv_heads, head_dim)
        self.scale = head_dim**-0.5

    def reference(self, sliding_window=None, softcap=None) -> torch.Tensor:
        key_cache, value_cache = self.key_cache.clone(), self.value_cache.clone()
        meta = AttentionMetadata.build(
            positions=self.positions,
            slot_mapping=self.slot_mapping,
            query_start_loc=self.query_start_loc,
            context_lens=self.context_lens,
            block_tables=self.block_tables,
            block_size=self.block_size,
            sliding_window=sliding_window,
            device=self.device,
        )
        return meta.attend(self.query, self.key, self.value, key_cache, value_cache, self.scale, softcap=softcap)

    def write(self, ops) -> None:
        ops.reshape_and_cache(
            self.key, self.value, self.key_cache, self.value_cache, torch.from_numpy(self.slot_mapping).to(self.device)
        )

    def device_arrays(self):
        def put(array):
            return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

        return put(self.block_tables), put(self.query_start_loc), put(self.context_lens)


def mixed_step() -> dict:
    """`build` arguments of a small step on the CPU: a decode (context 20), a prefill chunk of 3
    over a 10-token prefix (context 13), a decode (context 40): rows 0 | 1 2 3 | 4."""
    return dict(
        positions=np.array([19, 10, 11, 12, 39]),
        slot_mapping=np.arange(5),
        query_start_loc=np.array([0, 1, 4, 5], dtype=np.int32),
        context_lens=np.array([20, 13, 40], dtype=np.int32),
        block_tables=np.array([[5, 6, 0], [7, 0, 0], [1, 2, 3]], dtype=np.int32),
        block_size=16,
        sliding_window=None,
        device=torch.device("cpu"),
    )


def make_step(seqs, *, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """A step of ``seqs`` over a cache whose blocks are handed out shuffled: the cached
    prefixes already written, the step's own keys/values still to write. Returns the
    scheduler's arrays, the step's tensors and the caches."""
    generator = np.random.default_rng(seed)
    torch.manual_seed(seed)
    blocks_per_seq = [-(-context // block_size) for context, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    free_blocks = generator.permutation(num_blocks)
    width = max(blocks_per_seq)
    block_tables = np.zeros((len(seqs), width), dtype=np.int32)
    positions, slots, query_start_loc = [], [], [0]
    taken = 0
    for s, ((context, rows), num_seq_blocks) in enumerate(zip(seqs, blocks_per_seq)):
        block_tables[s, :num_seq_blocks] = free_blocks[taken : taken + num_seq_blocks]
        taken += num_seq_blocks
        for position in range(context - rows, context):
            positions.append(position)
            slots.append(block_tables[s, position // block_size] * block_size + position % block_size)
        query_start_loc.append(query_start_loc[-1] + rows)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    num_tokens = query_start_loc[-1]
    arrays = dict(
        positions=np.array(positions, dtype=np.int64),
        slot_mapping=np.array(slots, dtype=np.int64),
        query_start_loc=np.array(query_start_loc, dtype=np.int32),
        context_lens=np.array([context for context, _ in seqs], dtype=np.int32),
        block_tables=block_tables,
        block_size=block_size,
    )
    query = torch.randn(num_tokens, num_heads, head_dim).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    return arrays, (query, key, value), (key_cache, value_cache)
