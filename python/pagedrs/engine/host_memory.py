"""Host memory for CPU steps: freed memory kept in the process, and the weights in huge pages.

Freed memory kept (`retain_freed_host_memory`), so a CPU step does not fault its pages in again.

A step allocates many tensors of the same large sizes (activations, ``[rows, vocab]`` logits
and the sampler's temporaries: 50 MB at 256 rows of a 49K vocabulary). glibc serves blocks
that large with ``mmap`` and returns them to the kernel on free, so every step pays a page
fault per 4 KiB of each one: measured on this project's 2-core machine, ``clone()`` of such a
tensor took 17 ms instead of 3 ms, and a softmax 19 ms instead of 4.5 ms. Raising glibc's
mmap and trim thresholds keeps those blocks in the heap for the next step (vLLM gets the same
effect by preloading tcmalloc on CPU).

The cost: memory freed by the process stays resident (its peak, not its current use, is what
it holds). ``PAGEDRS_RETAIN_HOST_MEMORY=0`` turns this off.

The weights in huge pages (`place_in_huge_pages`). A CPU decode step reads every weight once:
the default model's 96.6 MB are 23 600 pages of 4 KiB, far more than a core's TLB holds (a few
thousand entries), so each page of the stream costs a page walk, and the stream evicts the
entries the interpreter and torch run from between the matmuls. Copied into one anonymous
mapping advised ``MADV_HUGEPAGE`` (Linux's transparent huge pages in ``madvise`` or ``always``
mode), the same bytes take 47 pages of 2 MiB (docs/cpu.md, "The weights in 2 MiB pages").
``PAGEDRS_WEIGHT_HUGE_PAGES=0`` turns this off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import os

import torch
from torch import nn

logger = logging.getLogger("pagedrs")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 1 << 30
_TRIM_THRESHOLD_BYTES = (1 << 31) - 1


@functools.cache
def retain_freed_host_memory() -> bool:
    """Sets glibc's thresholds once per process; ``False`` where that is not possible (not
    glibc, or turned off)."""
    if os.environ.get("PAGEDRS_RETAIN_HOST_MEMORY", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = (
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES) == 1
        and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES) == 1
    )
    if not ok:
        logger.info("could not raise glibc's mmap/trim thresholds; large host tensors are page-faulted every step")
    return ok


_HUGE_PAGE_BYTES = 2 << 20
_TENSOR_ALIGNMENT = 64  # each storage's start in the arena: a cache line, and any dtype's size
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
_MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)  # Linux 6.1 (x86 and arm64 number it 25)


def _huge_pages_available() -> bool:
    """Linux with transparent huge pages in ``always`` or ``madvise`` mode, and not turned off."""
    if os.environ.get("PAGEDRS_WEIGHT_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_ENABLED) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def place_in_huge_pages(model: nn.Module) -> int:
    """Moves the storage of every CPU parameter and buffer of ``model`` into one anonymous
    mapping advised for 2 MiB pages, in place: each tensor keeps its identity, values, shape and
    strides, tensors that shared a storage (tied weights, views) still share one, and the old
    storages are freed once nothing else holds them. Returns the bytes moved (0: nothing done, where
    huge pages are not available or the tensors fill less than one huge page). The mapping is
    unmapped when its last tensor is freed."""
    if not _huge_pages_available():
        return 0
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    by_storage: dict[int, list[torch.Tensor]] = {}
    for tensor in tensors.values():
        if tensor.device.type == "cpu" and tensor.untyped_storage().nbytes():
            by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    sizes = {ptr: group[0].untyped_storage().nbytes() for ptr, group in by_storage.items()}
    total = sum(-(-size // _TENSOR_ALIGNMENT) * _TENSOR_ALIGNMENT for size in sizes.values())
    if total < _HUGE_PAGE_BYTES:
        return 0
    # MAP_PRIVATE: Python's default for an anonymous mapping is shared memory, which the
    # transparent huge pages of anonymous memory do not cover.
    mapping = mmap.mmap(-1, total + _HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)  # before any page is touched: each fault takes a huge page
    arena = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping` while a tensor lives
    offset = -arena.data_ptr() % _HUGE_PAGE_BYTES
    arena_storage = arena.untyped_storage()
    with torch.no_grad():
        for ptr, group in by_storage.items():
            size = sizes[ptr]
            old = torch.empty(0, dtype=torch.uint8).set_(group[0].untyped_storage())
            arena[offset : offset + size].copy_(old)
            del old
            for tensor in group:
                itemsize = tensor.element_size()
                moved = torch.empty(0, dtype=tensor.dtype).set_(
                    arena_storage,
                    (offset + tensor.storage_offset() * itemsize) // itemsize,
                    tensor.shape,
                    tensor.stride(),
                )
                tensor.data = moved
            offset += -(-size // _TENSOR_ALIGNMENT) * _TENSOR_ALIGNMENT
    try:  # pages that faulted in small (no free huge page then) collapsed into huge ones now
        mapping.madvise(_MADV_COLLAPSE)
    except OSError:  # before Linux 6.1, or nothing left to collapse into
        pass
    logger.info("weights: %.1f MB placed in 2 MiB pages", total / 1e6)
    return total
