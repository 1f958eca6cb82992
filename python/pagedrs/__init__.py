"""pagedrs: an LLM serving engine with a paged KV cache and a Rust scheduling core."""

from pagedrs._core import (
    GrammarMatchers,
    KVCacheManager,
    KVCacheStats,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
    StepUpdates,
)
from pagedrs._core import __version__ as _core_version
from pagedrs.errors import (
    DuplicateRequestError,
    InternalError,
    InvalidArgumentError,
    PagedrsError,
    UnknownRequestError,
)
from pagedrs.outputs import (
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
    ScoringRequestOutput,
)
from pagedrs.pooling_params import PoolingParams
from pagedrs.sampling_params import SamplingParams

__version__ = _core_version

# The model side needs torch and transformers: import it on first use, so the scheduling
# core stays cheap to import.
_LAZY = {
    "LLM": "pagedrs.llm",
    "LLMEngine": "pagedrs.engine.llm_engine",
    "EngineConfig": "pagedrs.config",
    "LoRARequest": "pagedrs.lora.adapter",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedrs' has no attribute {name!r}")


__all__ = [
    "CompletionOutput",
    "EngineConfig",
    "LLM",
    "LLMEngine",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "PoolingParams",
    "EmbeddingRequestOutput",
    "ClassificationRequestOutput",
    "ScoringRequestOutput",
    "DuplicateRequestError",
    "GrammarMatchers",
    "InternalError",
    "InvalidArgumentError",
    "KVCacheManager",
    "KVCacheStats",
    "PagedrsError",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "StepUpdates",
    "UnknownRequestError",
    "__version__",
]
