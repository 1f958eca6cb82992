//! Counters the scheduler keeps for metrics; Python pulls a snapshot.

use crate::speculative::MAX_SPECULATIVE_TOKENS;

/// A snapshot of the scheduler's state and counters. Python reads it as
/// `pagedrs._core.SchedulerStats`, these fields as attributes (plus `kv_cache_usage`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[cfg_attr(
    feature = "python",
    pyo3::pyclass(name = "SchedulerStats", module = "pagedrs._core", frozen, get_all)
)]
pub struct SchedulerStats {
    /// Sequences holding blocks and scheduled every step.
    pub num_running: usize,
    /// Sequences queued (never run, or preempted).
    pub num_waiting: usize,
    /// Of the waiting, those that were preempted.
    pub num_preempted_waiting: usize,
    /// Preemptions since start.
    pub num_preemptions_total: u64,
    /// Running sequences (and fresh forks) requeued since start to keep a request within
    /// its fair share (`max_seqs_per_request`); not preemptions for want of blocks.
    pub num_fair_share_requeues_total: u64,
    /// Prompt tokens looked up in the prefix cache since start.
    pub prefix_cache_queries: u64,
    /// Of those, tokens found cached.
    pub prefix_cache_hits: u64,
    /// KV blocks referenced by a sequence.
    pub num_used_blocks: usize,
    /// Free KV blocks still holding a cached prefix.
    pub num_cached_free_blocks: usize,
    /// All KV blocks.
    pub num_blocks: usize,
    /// Cached blocks evicted since start.
    pub num_evictions: u64,
    /// Prefill tokens in the last scheduled step.
    pub step_num_prefill_tokens: usize,
    /// Decode tokens in the last scheduled step.
    pub step_num_decode_tokens: usize,
    /// Prompt tokens computed since start (prefix hits excluded, recomputation included).
    pub num_prefill_tokens_total: u64,
    /// Tokens sampled since start.
    pub num_generated_tokens_total: u64,
    /// Speculative steps of a sequence (a sequence that proposed at least one token) since
    /// start.
    pub num_drafts_total: u64,
    /// Tokens proposed since start.
    pub num_draft_tokens_total: u64,
    /// Proposed tokens accepted since start.
    pub num_accepted_tokens_total: u64,
    /// Accepted proposals by their position in the proposal (0 = first).
    pub num_accepted_tokens_per_pos: [u64; MAX_SPECULATIVE_TOKENS],
}

impl SchedulerStats {
    /// Fraction of blocks referenced by sequences (cached-free blocks count as free).
    pub fn kv_cache_usage(&self) -> f64 {
        self.num_used_blocks as f64 / self.num_blocks as f64
    }
}
