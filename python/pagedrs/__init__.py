"""pagedrs: an LLM serving engine with a paged KV cache and a Rust scheduling core."""

from pagedrs._core import KVCacheManager, KVCacheStats
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
    "UnknownRequestError",
    "__version__",
]
