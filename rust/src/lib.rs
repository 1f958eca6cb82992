//! pagedrs scheduling core: the paged KV block pool, exact prefix caching and the
//! per-iteration scheduler. Plain Rust, tested with `cargo test`; the PyO3 binding in
//! `python.rs` is compiled only with the `python` feature.

pub mod batch;
pub mod block_pool;
pub mod config;
pub mod error;
pub mod free_queue;
pub mod kv_cache_manager;
pub mod metrics;
pub mod prefix_cache;
pub mod request;
pub mod scheduler;

#[cfg(feature = "python")]
mod python;

pub use batch::{RequestUpdate, SchedulerOutput};
pub use block_pool::{BlockId, BlockPool, BlockRef};
pub use error::{Error, Result};
pub use kv_cache_manager::{BlockCopy, KVCacheManager, KVCacheStats, RequestId};
pub use metrics::SchedulerStats;
pub use prefix_cache::BlockHash;
pub use request::{FinishReason, StopConditions};
pub use scheduler::{RequestParams, Scheduler, SchedulerConfig, SchedulingPolicy};
