//! pagedrs scheduling core: the paged KV block pool, exact prefix caching and (soon) the
//! per-iteration scheduler. Plain Rust, tested with `cargo test`; the PyO3 binding in
//! `python.rs` is compiled only with the `python` feature.

pub mod block_pool;
pub mod error;
pub mod free_queue;
pub mod kv_cache_manager;
pub mod prefix_cache;

#[cfg(feature = "python")]
mod python;

pub use block_pool::{BlockId, BlockPool, BlockRef};
pub use error::{Error, Result};
pub use kv_cache_manager::{BlockCopy, KVCacheManager, KVCacheStats, RequestId};
pub use prefix_cache::BlockHash;
