//! The scheduler's settings and a new request's parameters.

use crate::error::{Error, Result};
use crate::sequence::StopConditions;
use crate::speculative::SpeculativeConfig;

/// Order in which waiting requests are admitted (and, reversed, running ones preempted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchedulingPolicy {
    /// First come, first served.
    Fcfs,
    /// Lower `priority` value first, ties by arrival.
    Priority,
}

/// Sizes and limits of the scheduler.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// KV blocks in the cache.
    pub num_blocks: usize,
    /// Token slots per block.
    pub block_size: usize,
    /// Whether full blocks are cached and reused across requests.
    pub enable_prefix_caching: bool,
    /// Model identity keying the prefix cache.
    pub namespace: String,
    /// The window of each KV layer group (`None`: full attention), group 0 first: each
    /// group has its own block table per sequence over the one pool, and a sliding group
    /// releases the blocks that fall out of its window. One full group unless the model
    /// has sliding-window layers.
    pub kv_group_windows: Vec<Option<usize>>,
    /// Token budget of one step.
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Longest sequence (prompt + output) the model handles.
    pub max_model_len: usize,
    /// Admission order.
    pub policy: SchedulingPolicy,
    /// Most tokens one prefill may compute in one step (`None`: no cap beyond the budget).
    pub long_prefill_token_threshold: Option<usize>,
    /// Most requests with an unfinished prefill at once.
    pub max_num_partial_prefills: usize,
    /// Most seats one request holds while another request is live (`None`: no share).
    /// See the fair share on `Scheduler::schedule`.
    pub max_seqs_per_request: Option<usize>,
    /// Speculative decoding (`None`: off).
    pub speculative: Option<SpeculativeConfig>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            num_blocks: 1024,
            block_size: 16,
            enable_prefix_caching: true,
            namespace: String::new(),
            kv_group_windows: vec![None],
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            max_model_len: 8192,
            policy: SchedulingPolicy::Fcfs,
            long_prefill_token_threshold: None,
            max_num_partial_prefills: 1,
            max_seqs_per_request: None,
            speculative: None,
        }
    }
}

impl SchedulerConfig {
    /// Checks every limit is usable; the scheduler refuses to start otherwise.
    pub(crate) fn validate(&self) -> Result<()> {
        let positive = [
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_num_seqs", self.max_num_seqs),
            ("max_model_len", self.max_model_len),
            ("max_num_partial_prefills", self.max_num_partial_prefills),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(Error::InvalidArgument(format!("{name} must be at least 1")));
            }
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return Err(Error::InvalidArgument(format!(
                "max_num_batched_tokens ({}) must be >= max_num_seqs ({}), so every running \
                 sequence can decode each step",
                self.max_num_batched_tokens, self.max_num_seqs
            )));
        }
        if self.max_seqs_per_request == Some(0) {
            return Err(Error::InvalidArgument(
                "max_seqs_per_request must be at least 1 (or unset)".into(),
            ));
        }
        if self.long_prefill_token_threshold == Some(0) {
            return Err(Error::InvalidArgument(
                "long_prefill_token_threshold must be at least 1 (or unset)".into(),
            ));
        }
        crate::kv_cache_manager::check_group_windows(&self.kv_group_windows)?;
        if let Some(speculative) = &self.speculative {
            speculative.validate()?;
        }
        Ok(())
    }
}

/// Everything about a new request besides its id and prompt.
#[derive(Debug, Clone)]
pub struct RequestParams {
    /// When to stop.
    pub stop: StopConditions,
    /// Independent choices to generate from one prompt.
    pub n: usize,
    /// Lower runs first under the priority policy.
    pub priority: i64,
    /// Isolates this request's prefix cache entries from requests with another salt.
    pub cache_salt: Option<String>,
    /// Arrival time for ordering; `None`: the order of `add_request` calls.
    pub arrival_time: Option<f64>,
    /// Whether its choices may speculate when the scheduler does (the caller turns it off
    /// for sampling rules the verifier does not cover).
    pub speculate: bool,
    /// Whether the caller wants the logits of every prompt position (prompt logprobs): the
    /// request then takes no cached prefix and computes its whole prompt. Its own full
    /// blocks are still cached for the requests after it.
    pub prompt_logprobs: bool,
}

impl Default for RequestParams {
    /// One choice, the default stop conditions, priority 0, no salt, arrival by call order,
    /// speculation allowed, no prompt logprobs.
    fn default() -> Self {
        RequestParams {
            stop: StopConditions::default(),
            n: 1,
            priority: 0,
            cache_salt: None,
            arrival_time: None,
            speculate: true,
            prompt_logprobs: false,
        }
    }
}
