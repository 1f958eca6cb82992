"""Attention time of one layer on the CPU, on SmolLM2-135M's shapes (9 query heads, 3 KV
heads, head size 64, float32, blocks of 16): the torch reference; the "cpu" backend (the
compiled kernel, long prefill chunks through scaled_dot_product_attention); and the kernel
alone for every row (what the backend would do without the SDPA path).

    .venv/bin/python benches/bench_cpu_attention.py [--threads N] [--repeat R] [--cache-dtype bfloat16]

``--cache-dtype``: the caches in bfloat16, float16 or fp8 (e4m3) under float32 queries
(``kv_cache_dtype``).

Each number is the median over R calls of ``meta.attend`` (the write of the step's new keys
and values included, the per-step metadata build not: it is shared by every layer), in ms,
with glibc keeping freed memory as the engine has it (`retain_freed_host_memory`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pagedrs.attention import cpu_backend
from pagedrs.attention.cpu_backend import CpuAttentionMetadata
from pagedrs.attention.torch_ref import AttentionMetadata
from pagedrs.config import resolve_kv_cache_dtype
from pagedrs.engine.host_memory import retain_freed_host_memory
from pagedrs.kernels.cpu import load

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers import batches

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def make_step(seqs: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
    """(context, rows) per sequence over a cache whose blocks are handed out shuffled (the
    tests' step builder, with SmolLM2's shapes)."""
    arrays, qkv, caches = batches.make_step(
        seqs,
        block_size=BLOCK_SIZE,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=dtype,
        seed=seed,
    )
    return {**arrays, "sliding_window": None, "device": torch.device("cpu")}, qkv, caches


def median_ms(meta, qkv, caches, repeat: int) -> float:
    scale = HEAD_DIM**-0.5
    times = []
    for i in range(repeat + 2):
        start = time.perf_counter()
        meta.attend(*qkv, *caches, scale)
        if i >= 2:  # two warm-up calls
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument(
        "--cache-dtype", default="float32", choices=["float32", "bfloat16", "float16", "fp8", "fp8_e4m3"]
    )
    args = parser.parse_args()
    cache_dtype = resolve_kv_cache_dtype(args.cache_dtype, torch.float32, torch.device("cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    retain_freed_host_memory()  # as the engine does: no page faults on every call's temporaries
    load()
    generator = np.random.default_rng(1)
    cases = {
        "decode  one sequence, context 70": [(70, 1)],
        "decode  one sequence, context 500": [(500, 1)],
        "decode  batch 64, context ~500": [(int(c), 1) for c in generator.integers(450, 551, 64)],
        "decode  batch 256, context ~100": [(int(c), 1) for c in generator.integers(80, 121, 256)],
        "decode  batch 256, contexts 20..1000": [(int(c), 1) for c in generator.integers(20, 1001, 256)],
        "prefill one 512-token prompt": [(512, 512)],
        "prefill 256-token chunk after 768 cached": [(1024, 256)],
        "prefill 4 chunks of 32 rows after ~570 cached": [(600, 32)] * 4,
        "prefill 4 chunks of 16 rows after ~580 cached": [(600, 16)] * 4,
        "mixed   64 decodes ~500 + 512-token chunk": [(int(c), 1) for c in generator.integers(450, 551, 64)]
        + [(512, 512)],
    }
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 (caches {args.cache_dtype}), "
        f"H={NUM_HEADS} KVH={NUM_KV_HEADS} D={HEAD_DIM} block={BLOCK_SIZE}; median ms per layer"
    )
    print(f"{'case':44} {'torch ref':>10} {'cpu':>8} {'kernel only':>12}")
    sdpa_min_rows = cpu_backend.SDPA_MIN_ROWS
    with torch.inference_mode():
        for name, seqs in cases.items():
            arrays, qkv, caches = make_step(seqs, torch.float32)
            caches = tuple(cache.to(cache_dtype) for cache in caches)
            reference = median_ms(AttentionMetadata.build(**arrays), qkv, caches, args.repeat)
            backend = median_ms(CpuAttentionMetadata.build(**arrays), qkv, caches, args.repeat)
            cpu_backend.SDPA_MIN_ROWS = 1 << 30
            kernel_only = median_ms(CpuAttentionMetadata.build(**arrays), qkv, caches, args.repeat)
            cpu_backend.SDPA_MIN_ROWS = sdpa_min_rows
            print(f"{name:44} {reference:10.3f} {backend:8.3f} {kernel_only:12.3f}", flush=True)


if __name__ == "__main__":
    main()
