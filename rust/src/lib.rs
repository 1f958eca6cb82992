//! pagedrs scheduling core: the paged KV block pool, exact prefix caching, the
//! per-iteration scheduler, and structured-output token masks (`structured`, over
//! llguidance). Plain Rust, tested with `cargo test`; the PyO3 binding in `python/` is
//! compiled only with the `python` feature.
//!
//! Vocabulary: a caller's *request* (one id, `n` choices) runs as `n` *sequences*, one per
//! choice; the scheduler batches sequences and the KV cache holds one block table per
//! sequence.

pub mod batch;
pub mod block_id;
pub mod block_pool;
pub mod config;
pub mod error;
pub mod free_queue;
pub mod kv_cache_manager;
pub mod metrics;
pub mod prefix_cache;
pub mod scheduler;
pub mod sequence;
pub mod speculative;
pub mod structured;

#[cfg(feature = "python")]
mod python;

pub use batch::{SchedulerOutput, SequenceUpdate};
pub use block_id::BlockId;
pub use block_pool::{BlockPool, BlockRef};
pub use error::{Error, Result};
pub use kv_cache_manager::{BlockCopy, KVCacheManager, KVCacheStats, SequenceId};
pub use metrics::SchedulerStats;
pub use prefix_cache::BlockHash;
pub use scheduler::{RequestParams, Scheduler, SchedulerConfig, SchedulingPolicy};
pub use sequence::{FinishReason, RequestHandle, StopConditions};
pub use speculative::{SpeculativeConfig, SpeculativeMethod};
pub use structured::{GrammarId, GrammarKind, GrammarMatchers, MatcherHandle, StructuredStats};
