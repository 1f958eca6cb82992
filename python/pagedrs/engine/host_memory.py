"""Keep freed host memory in the process, so a CPU step does not fault its pages in again.

A step allocates many tensors of the same large sizes (activations, ``[rows, vocab]`` logits
and the sampler's temporaries: 50 MB at 256 rows of a 49K vocabulary). glibc serves blocks
that large with ``mmap`` and returns them to the kernel on free, so every step pays a page
fault per 4 KiB of each one: measured on this project's 2-core machine, ``clone()`` of such a
tensor took 17 ms instead of 3 ms, and a softmax 19 ms instead of 4.5 ms. Raising glibc's
mmap and trim thresholds keeps those blocks in the heap for the next step (vLLM gets the same
effect by preloading tcmalloc on CPU).

The cost: memory freed by the process stays resident (its peak, not its current use, is what
it holds). ``PAGEDRS_RETAIN_HOST_MEMORY=0`` turns this off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

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
