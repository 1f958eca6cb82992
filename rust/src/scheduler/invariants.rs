//! `Scheduler::check_invariants`: the scheduler's bookkeeping checked against itself and
//! against the KV cache, after every operation of the randomized tests.

use std::collections::HashSet;

use super::Scheduler;
use crate::block_id::BlockId;
use crate::error::{Error, Result};
use crate::sequence::SequenceStatus;

impl Scheduler {
    /// Checks every invariant below; returns the first violation as
    /// `Error::InvariantViolation`. Between any two calls of the public API:
    ///
    /// - blocks: the pool's own invariants hold (see `block_pool`); each block's ref count
    ///   is the number of block tables holding it, so every held block is referenced and
    ///   the used and free blocks add up to all of them;
    /// - queues: every live sequence is in exactly one queue, the one its status names:
    ///   `running` (sorted by queue key) or `waiting` (under its own key); the KV cache
    ///   holds exactly the live sequences;
    /// - tokens: a sequence has computed at most its known tokens (the KV cache's), a
    ///   running one holds a slot for every computed token, a waiting one holds no block;
    /// - seats: the running sequences and the forks they reserved fit `max_num_seqs`; a
    ///   sequence reserves only forks still to come, and only while it runs;
    /// - requests: each sequence's request is live and lists it under its choice index; a
    ///   request's live count is its live sequences plus the forks still to come.
    pub fn check_invariants(&self) -> Result<()> {
        self.check_blocks().map_err(Error::InvariantViolation)?;
        self.check_queues().map_err(Error::InvariantViolation)?;
        self.check_requests().map_err(Error::InvariantViolation)
    }

    fn check_blocks(&self) -> std::result::Result<(), String> {
        let pool = self.kv.pool();
        pool.check_invariants()?;
        if self.kv.num_sequences() != self.sequences.len() {
            return Err(format!(
                "the KV cache holds {} sequences, the scheduler {}",
                self.kv.num_sequences(),
                self.sequences.len()
            ));
        }
        let mut num_holders = vec![0u32; pool.num_blocks()];
        for seq in self.sequences.iter() {
            for table in self.kv.block_tables(seq.id).map_err(|err| err.to_string())? {
                for block in table.iter().filter(|&&block| block != BlockId::NULL) {
                    num_holders[block.index()] += 1;
                }
            }
        }
        let mut num_held = 0;
        for (index, &count) in num_holders.iter().enumerate() {
            let ref_count = pool.ref_count(BlockId(index as u32));
            if ref_count != count {
                return Err(format!(
                    "block {index}: ref count {ref_count}, held by {count} tables"
                ));
            }
            num_held += usize::from(count > 0);
        }
        if num_held + pool.num_free_blocks() != pool.num_blocks() {
            return Err(format!(
                "{num_held} held blocks and {} free ones, of {}",
                pool.num_free_blocks(),
                pool.num_blocks()
            ));
        }
        Ok(())
    }

    fn check_queues(&self) -> std::result::Result<(), String> {
        let block_size = self.config.block_size;
        let running: HashSet<_> = self.running.iter().copied().collect();
        if running.len() != self.running.len() {
            return Err("a sequence is in the running list twice".into());
        }
        if self.running.len() + self.waiting.len() != self.sequences.len() {
            return Err(format!(
                "{} running and {} waiting, but {} live sequences",
                self.running.len(),
                self.waiting.len(),
                self.sequences.len()
            ));
        }
        if !self.running.windows(2).all(|pair| {
            self.sequences.get(pair[0]).map(|seq| seq.key)
                < self.sequences.get(pair[1]).map(|seq| seq.key)
        }) {
            return Err("the running list is not sorted by queue key".into());
        }
        let mut num_seats = 0;
        for seq in self.sequences.iter() {
            let id = seq.id;
            let num_known = self.kv.token_ids(id).map_err(|err| err.to_string())?.len();
            let num_blocks = self.kv.block_table(id).map_err(|err| err.to_string())?.len();
            if seq.num_tokens != num_known || seq.num_computed_tokens > seq.num_tokens {
                return Err(format!(
                    "sequence {id}: {} computed of {} tokens, the KV cache knows {num_known}",
                    seq.num_computed_tokens, seq.num_tokens
                ));
            }
            let reserved_right = seq.num_reserved_forks <= seq.num_pending_forks
                && (seq.num_reserved_forks == 0 || seq.status == SequenceStatus::Running);
            if !reserved_right {
                return Err(format!(
                    "sequence {id} ({}) reserves {} seats for {} forks to come",
                    seq.status.as_str(),
                    seq.num_reserved_forks,
                    seq.num_pending_forks
                ));
            }
            let queued_right = match seq.status {
                SequenceStatus::Running => {
                    num_seats += 1 + seq.num_reserved_forks;
                    running.contains(&id)
                        && num_blocks >= seq.num_computed_tokens.div_ceil(block_size)
                }
                SequenceStatus::Waiting | SequenceStatus::Preempted => {
                    !running.contains(&id)
                        && self.waiting.get(&seq.key) == Some(&id)
                        && num_blocks == 0
                        && seq.num_computed_tokens == 0
                }
            };
            if !queued_right {
                return Err(format!(
                    "sequence {id} ({}) is in the wrong queue or holds the wrong blocks ({} \
                     computed tokens, {num_blocks} blocks)",
                    seq.status.as_str(),
                    seq.num_computed_tokens
                ));
            }
        }
        if num_seats > self.config.max_num_seqs {
            return Err(format!(
                "{num_seats} seats taken by running sequences and their forks, max_num_seqs is {}",
                self.config.max_num_seqs
            ));
        }
        Ok(())
    }

    fn check_requests(&self) -> std::result::Result<(), String> {
        if self.requests.num_external_ids() != self.requests.len() {
            return Err(format!(
                "{} request ids for {} requests",
                self.requests.num_external_ids(),
                self.requests.len()
            ));
        }
        for seq in self.sequences.iter() {
            let Some(request) = self.requests.get(seq.request) else {
                return Err(format!("sequence {} belongs to no live request", seq.id));
            };
            if request.choices.get(seq.choice_index) != Some(&seq.id) {
                return Err(format!(
                    "request {:?} does not list sequence {} as choice {}",
                    request.external_id, seq.id, seq.choice_index
                ));
            }
        }
        for (handle, request) in self.requests.iter() {
            if self.requests.handle(&request.external_id) != Some(handle) {
                return Err(format!("request {:?} is not found by its id", request.external_id));
            }
            let live = request.choices.iter().filter_map(|&id| self.sequences.get(id));
            let expected: usize = live.map(|seq| 1 + seq.num_pending_forks).sum();
            if request.num_live != expected {
                return Err(format!(
                    "request {:?} counts {} live choices, has {expected}",
                    request.external_id, request.num_live
                ));
            }
        }
        Ok(())
    }
}
