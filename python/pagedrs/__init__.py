"""pagedrs: an LLM serving engine with a paged KV cache and a Rust scheduling core."""

from pagedrs._core import (
    KVCacheManager,
    KVCacheStats,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
)
from pagedrs._core import __version__ as _core_version
from pagedrs.errors import (
    DuplicateRequestError,
    InternalError,
    InvalidArgumentError,
    PagedrsError,
    UnknownRequestError,
)

__version__ = _core_version

__all__ = [
    "DuplicateRequestError",
    "InternalError",
    "InvalidArgumentError",
    "KVCacheManager",
    "KVCacheStats",
    "PagedrsError",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "UnknownRequestError",
    "__version__",
]
