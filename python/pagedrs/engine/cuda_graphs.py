"""CUDA graphs for decode steps: one captured forward pass per batch-size bucket.

A decode step of a small model is mostly launch overhead: a thousand small kernels, each a few
microseconds of host time. Replaying a captured graph launches them all at once. A graph
fixes every address and shape it touches, so:

- Each bucket (1, 2, 4, 8, ... up to ``max_num_seqs``) is captured once at start-up, from the
  largest down, sharing one memory pool. A step of ``n`` sequences replays the smallest bucket
  ``b >= n``; rows ``n .. b`` are padding.
- The step's arrays go into one persistent buffer (pinned on the host, and on the device) at
  fixed offsets, with one host-to-device copy per step. Padding rows read block 0 with a
  context of one token and write their key/value to a scratch block past the scheduler's
  blocks (the runner allocates it), so they never touch a sequence's cache.
- The attention launch has the same grid for any contexts: block tables as wide as
  ``max_model_len`` (at most the whole pool), and the Triton kernel with a split-K count fixed
  per bucket (each sequence cuts its own context into that many parts), whichever kernel the
  eager plan picked for decode. Only where Triton cannot take the shape does the CUDA kernel
  run, told the longest possible context; its empty partitions still cost a little each, so
  that path slows with ``max_model_len``.

Steps with prefill chunks, block copies, prompt-logprob rows or more sequences than the
largest bucket run eagerly, as do all steps with ``enforce_eager`` (vLLM's name) and tensor
parallelism. On a CPU (tests only) the "capture" is the same function run eagerly on the
same buffers, which checks the layout, the padding and the fixed launch shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedrs.attention import AttentionBackend, triton_attention
from pagedrs.attention.cuda_backend import CudaAttentionMetadata, _Group, _TritonLaunch
from pagedrs.kernels import triton as triton_runtime

_ALIGN = 64
"""Bytes each field's start is aligned to in the persistent buffers."""


@dataclass(frozen=True)
class GraphSettings:
    """What the captured graphs must cover."""

    max_model_len: int
    max_num_seqs: int


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two up to ``max_num_seqs``, and ``max_num_seqs`` itself last."""
    buckets = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return [*buckets, max_num_seqs]


Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]
"""Turns a forward function into a replay function returning the same output tensor."""


def capture_cuda_graph(pool: Any) -> Capture:
    """Captures with `torch.cuda.graph` into ``pool`` after one warm-up run on a side stream
    (compiling Triton kernels and setting up cuBLAS before capture, as torch's docs advise)."""

    def capture(forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


class _Fields:
    """Named arrays at fixed offsets of one host buffer and one device buffer of the same layout."""

    def __init__(self, device: torch.device, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        offsets, end = {}, 0
        for name, (shape, dtype) in shapes.items():
            offsets[name] = end
            end += -(-int(np.prod(shape)) * dtype.itemsize // _ALIGN) * _ALIGN
        self.num_bytes = end
        self.host = torch.zeros(end, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.device = torch.zeros(end, dtype=torch.uint8, device=device)
        self.host_arrays: dict[str, np.ndarray] = {}
        self.device_tensors: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in shapes.items():
            size = int(np.prod(shape)) * dtype.itemsize
            start = offsets[name]
            self.host_arrays[name] = self.host[start : start + size].view(dtype).view(shape).numpy()
            self.device_tensors[name] = self.device[start : start + size].view(dtype).view(shape)
        self.offsets = offsets

    def send(self, num_bytes: int) -> None:
        """The first ``num_bytes`` of the host buffer to the device (one copy)."""
        if self.device.device.type == "cuda":
            self.device[:num_bytes].copy_(self.host[:num_bytes], non_blocking=True)
        else:
            self.device[:num_bytes].copy_(self.host[:num_bytes])


class DecodeGraphs:
    """The captured decode forwards of one runner (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        settings: GraphSettings,
        block_size: int,
        num_blocks: int,
        sliding_window: int | None,
        capture: Capture,
    ):
        """``backend``: a `graphable` one, whose `kernel_plan` the captured launches follow;
        ``num_blocks``: the scheduler's blocks; the cache has one more, the scratch block."""
        plan = backend.kernel_plan
        if not backend.graphable or plan is None:
            raise ValueError(f"the {backend.name!r} attention backend cannot be captured in CUDA graphs")
        self.buckets = batch_buckets(settings.max_num_seqs)
        self.scratch_slot = num_blocks * block_size
        largest = self.buckets[-1]
        width = min(-(-settings.max_model_len // block_size), num_blocks)
        device = kv_caches[0][0].device
        # NOTE: block tables last, so a step copies only up to its bucket's rows of them.
        self.fields = _Fields(
            device,
            {
                "input_ids": ((largest,), torch.int64),
                "positions": ((largest,), torch.int64),
                "slot_mapping": ((largest,), torch.int64),
                "context_lens": ((largest,), torch.int32),
                "block_tables": ((largest, width), torch.int32),
            },
        )
        host = self.fields.host_arrays
        self._pad(0, largest)
        host["block_tables"][:] = 0
        self.fields.send(self.fields.num_bytes)
        tensors = self.fields.device_tensors
        rows = torch.arange(largest + 1, dtype=torch.int32, device=device)
        logits_rows = rows[:largest].long()
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        for bucket in reversed(self.buckets):  # the largest first: the pool's size is set once
            launch = None
            if triton_attention.supports(plan.head_dim, block_size) is None and triton_runtime.available():
                config = plan.tile_config(decode=True)
                segments = triton_attention.num_segments_for(
                    bucket, plan.num_kv_heads, settings.max_model_len, config.block_n
                )
                launch = _TritonLaunch(config, rows[:bucket], rows[:bucket], segments)
            meta = CudaAttentionMetadata(
                slot_mapping=tensors["slot_mapping"][:bucket],
                decodes=_Group(
                    rows=None,
                    block_tables=tensors["block_tables"][:bucket],
                    cu_seqlens_q=rows[: bucket + 1],
                    context_lens=tensors["context_lens"][:bucket],
                    max_context_len=width * block_size,
                    num_rows=bucket,
                    triton=launch,
                ),
                prefills=None,
                sliding_window=sliding_window or 0,
                cuda_writes=plan.uses("cuda"),
            )

            def forward(bucket: int = bucket, meta: CudaAttentionMetadata = meta) -> torch.Tensor:
                return model(
                    tensors["input_ids"][:bucket], tensors["positions"][:bucket], kv_caches, meta, logits_rows[:bucket]
                )

            self._replays[bucket] = capture(forward)
        self.num_replays = 0
        """Steps run by replaying a graph (the rest ran eagerly)."""

    def _pad(self, start: int, end: int) -> None:
        """Rows ``start .. end`` as padding: token 0 at position 0, a context of one token in
        block 0 (read, never written), the key/value written to the scratch slot."""
        host = self.fields.host_arrays
        host["input_ids"][start:end] = 0
        host["positions"][start:end] = 0
        host["slot_mapping"][start:end] = self.scratch_slot
        host["context_lens"][start:end] = 1
        host["block_tables"][start:end, 0] = 0

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` rows (``None``: more than the largest)."""
        index = int(np.searchsorted(self.buckets, num_seqs))
        return self.buckets[index] if index < len(self.buckets) else None

    def can_run(
        self, query_start_loc: np.ndarray, logits_rows: np.ndarray, block_tables: np.ndarray, num_copies: int
    ) -> bool:
        """Whether a step is a plain decode a graph covers: one query row per sequence, no
        more sequences than the largest bucket, no block copies, logits of every row in order."""
        num_seqs = len(query_start_loc) - 1
        return (
            0 < num_seqs <= self.buckets[-1]
            and int(query_start_loc[-1]) == num_seqs
            and num_copies == 0
            and len(logits_rows) == num_seqs
            and int(logits_rows[-1]) == num_seqs - 1
            and block_tables.shape[1] <= self.fields.host_arrays["block_tables"].shape[1]
        )

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        context_lens: np.ndarray,
        block_tables: np.ndarray,
    ) -> torch.Tensor:
        """Float32 logits ``[num_seqs, vocab]`` of a step `can_run` accepted. They live in the
        graph's output buffer: read them before the next step."""
        num_seqs = len(input_ids)
        bucket = self.bucket_for(num_seqs)
        if bucket is None:
            raise ValueError(f"{num_seqs} sequences exceed the largest captured batch {self.buckets[-1]}")
        host = self.fields.host_arrays
        host["input_ids"][:num_seqs] = input_ids
        host["positions"][:num_seqs] = positions
        host["slot_mapping"][:num_seqs] = slot_mapping
        host["context_lens"][:num_seqs] = context_lens
        # NOTE: entries past a row's context are never read (the kernels stop at the context),
        # so a narrower table leaves the rest of the row as it was.
        host["block_tables"][:num_seqs, : block_tables.shape[1]] = block_tables
        self._pad(num_seqs, bucket)
        # NOTE: reusing the pinned buffer is safe for the reason StagedInputs gives: every step
        # ends by copying its sampled tokens to the host, which waits for this copy to finish.
        table_row_bytes = host["block_tables"].shape[1] * 4
        self.fields.send(self.fields.offsets["block_tables"] + bucket * table_row_bytes)
        self.num_replays += 1
        return self._replays[bucket]()[:num_seqs]
