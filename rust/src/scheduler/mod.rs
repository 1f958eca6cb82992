//! The per-iteration scheduler: continuous batching, chunked prefill, preemption.
//!
//! It owns every request and the `KVCacheManager`. A caller's *request* (one id, `n`
//! choices) runs as `n` *sequences*, one per choice; the scheduler batches sequences. Each
//! step the caller runs: `schedule()` (which sequences compute how many tokens), the model,
//! then `update_from_output(sampled)` (append the sampled tokens, apply stop conditions,
//! free what finished). Requests may be added, aborted or finished between steps.
//!
//! The rule is stated once, on `schedule`. Around it: `requests` (the request table and
//! the request-level calls), `admission` (admission and preemption), `speculative` (who
//! proposes, how far), `invariants` (`check_invariants`).

mod admission;
mod invariants;
mod requests;
mod speculative;

use std::collections::BTreeMap;

use self::admission::{Admission, StepChanges};
use self::requests::RequestTable;
use self::speculative::SpecState;
use crate::batch::{ScheduledSeq, SchedulerOutput, SequenceUpdate};
pub use crate::config::{RequestParams, SchedulerConfig, SchedulingPolicy};
use crate::error::{Error, Result};
use crate::kv_cache_manager::{KVCacheManager, SequenceId};
use crate::metrics::SchedulerStats;
use crate::sequence::{FinishReason, QueueKey, SequenceStatus, SequenceTable};

/// A sequence of the last schedule that samples, and how.
#[derive(Debug, Clone, Copy)]
struct LogitsOwner {
    /// The sequence.
    id: SequenceId,
    /// Its logits rows: 1, `n` for a prompt that forks, or 1 + its proposals.
    num_rows: usize,
    /// Proposals it verifies (its first `num_drafts` rows).
    num_drafts: usize,
}

/// The scheduler.
#[derive(Debug)]
pub struct Scheduler {
    /// Sizes and limits.
    config: SchedulerConfig,
    /// Blocks of every sequence.
    kv: KVCacheManager,
    /// Every live sequence.
    sequences: SequenceTable,
    /// Running sequences sorted by queue key: scheduled from the front, preempted from the
    /// back.
    running: Vec<SequenceId>,
    /// Waiting and preempted sequences in admission order.
    waiting: BTreeMap<QueueKey, SequenceId>,
    /// Live caller requests.
    requests: RequestTable,
    /// Speculative decoding's state (`None`: off).
    spec: Option<SpecState>,
    /// Sequences of the last schedule that sample, in row order.
    last_logits_owners: Vec<LogitsOwner>,
    /// Proposals of the last schedule, in row order (`LogitsOwner::num_drafts` each).
    last_drafts: Vec<u32>,
    /// Sequences `schedule` ended on its own (capacity), delivered by the next
    /// `update_from_output`. Finishes the caller decided (aborts, stop strings) are not
    /// queued: the caller already knows.
    pending_updates: Vec<SequenceUpdate>,
    /// `QueueKey::arrival_order` of the next sequence queued (added or forked).
    next_arrival_order: u64,
    /// Counters.
    stats: SchedulerStats,
}

impl Scheduler {
    /// A scheduler with an empty queue and a free KV cache.
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        config.validate()?;
        let kv = KVCacheManager::with_groups(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            &config.namespace,
            &config.kv_group_windows,
        )?;
        Ok(Scheduler {
            spec: config.speculative.as_ref().map(SpecState::new),
            config,
            kv,
            sequences: SequenceTable::default(),
            running: Vec::new(),
            waiting: BTreeMap::new(),
            requests: RequestTable::default(),
            last_logits_owners: Vec::new(),
            last_drafts: Vec::new(),
            pending_updates: Vec::new(),
            next_arrival_order: 0,
            stats: SchedulerStats::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The KV cache (read-only).
    pub fn kv_cache(&self) -> &KVCacheManager {
        &self.kv
    }

    /// Whether any request is waiting or running.
    pub fn has_unfinished_requests(&self) -> bool {
        !self.sequences.is_empty() || !self.pending_updates.is_empty()
    }

    /// Sequences running.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Sequences waiting (preempted included).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> SchedulerStats {
        let kv = self.kv.stats();
        SchedulerStats {
            num_running: self.running.len(),
            num_waiting: self.waiting.len(),
            num_preempted_waiting: self
                .waiting
                .values()
                .filter(|&&id| self.sequences[id].status == SequenceStatus::Preempted)
                .count(),
            prefix_cache_queries: kv.prefix_cache_queries,
            prefix_cache_hits: kv.prefix_cache_hits,
            num_used_blocks: kv.num_used_blocks,
            num_cached_free_blocks: kv.num_cached_free_blocks,
            num_blocks: kv.num_blocks,
            num_evictions: kv.num_evictions,
            ..self.stats
        }
    }

    /// Decides this step's batch.
    ///
    /// THE RULE: under a per-step token budget (`max_num_batched_tokens`) and a sequence
    /// cap (`max_num_seqs`), each sequence's computed tokens catch up with its known
    /// tokens. Running sequences go first, in queue order, each taking what it lacks: one
    /// token (a decode, or a prompt's last), or its next prefill chunk (capped by
    /// `long_prefill_token_threshold`, and leaving one token of budget for every sequence
    /// behind it that lacks one, so a long prompt never starves the decodes). Then waiting
    /// sequences are admitted in queue order, starting from their cached prefix, while
    /// budget, cap, free blocks and the partial-prefill limit allow; the first that does
    /// not fit stops admission. When a running sequence cannot get a block, the running
    /// sequence last in queue order is preempted (its blocks freed, requeued to
    /// recompute), possibly itself. A sequence that cannot fit even alone ends with
    /// `FinishReason::Capacity`.
    ///
    /// With speculative decoding, a sequence decoding an output token also proposes up to
    /// `k` tokens after it (see `speculative`), within the budget left after one token for
    /// every one-token sequence behind it; proposals never cause a preemption (a sequence
    /// that cannot get their slots, or whose proposals would take the block a sequence
    /// behind it needs, decodes without them), no sequence proposes in a step that runs
    /// `disable_by_batch_size` sequences or more, and a sequence proposes about as many
    /// tokens as it had accepted last time, less and less often while none are.
    ///
    /// FAIR SHARE (`max_seqs_per_request`): a running sequence holds a seat, and a running
    /// prompt with `n > 1` one more for each choice it will fork into. While more than one
    /// request is live, no request holds more than `max_seqs_per_request` seats: before
    /// anything else, a request over it gives back its prompt's reserved forks, then its
    /// running sequences, last in queue order first (requeued to recompute, as a
    /// preemption is); admission passes over the waiting sequences of a request that holds
    /// its share, and a prompt admitted reserves forks only up to it. Every choice's first
    /// token is still sampled from the prompt's logits; the forks past the reserved ones
    /// are requeued at once and wait their turn. A request alone may take every seat.
    pub fn schedule(&mut self) -> Result<SchedulerOutput> {
        let block_size = self.config.block_size;
        let mut budget = self.config.max_num_batched_tokens;
        let mut scheduled: Vec<ScheduledSeq> = Vec::with_capacity(self.running.len());
        let mut changes = StepChanges::default();
        let fair_share = self.hold_fair_share(&mut changes)?;
        let num_requeued_for_share = changes.preempted.len();
        // Running sequences after the current one that lack exactly one token.
        let mut num_one_token_behind = 0;
        // A prompt with n > 1 holds a seat for each choice it will fork into.
        let mut num_fork_seats = 0;
        for &id in &self.running {
            num_one_token_behind += usize::from(self.lacks_one_token(id));
            num_fork_seats += self.sequences[id].num_reserved_forks;
        }
        let mut num_partial_prefills = 0;
        let speculating =
            self.spec.as_ref().is_some_and(|spec| spec.allows_step(self.running.len()));
        let mut drafts: Vec<u32> = Vec::new();
        let mut step_drafts: Vec<u32> = Vec::new();

        let mut index = 0;
        while index < self.running.len() {
            let id = self.running[index];
            let seq = &self.sequences[id];
            let start = seq.num_computed_tokens;
            let remaining = seq.num_tokens - start;
            let lacks_one = remaining == 1;
            if lacks_one {
                num_one_token_behind -= 1;
            }
            let reserved = if lacks_one { 0 } else { num_one_token_behind };
            let num_new = self.cap_chunk(remaining, budget.saturating_sub(reserved));
            if num_new == 0 {
                num_partial_prefills += usize::from(remaining > 0);
                index += 1;
                continue;
            }
            drafts.clear();
            if speculating && lacks_one {
                // Every one-token sequence behind still gets its token, and its block
                // (`num_free_blocks` counts evictable ones): proposals take only what is left
                // of both.
                let room = budget.saturating_sub(num_new + num_one_token_behind);
                self.propose(id, room, &mut drafts)?;
                let end = start + num_new;
                let num_draft_blocks =
                    (end + drafts.len()).div_ceil(block_size) - end.div_ceil(block_size);
                let num_groups = self.kv.num_groups();
                if (num_draft_blocks + 1 + num_one_token_behind) * num_groups
                    > self.kv.num_free_blocks()
                {
                    drafts.clear();
                }
            }
            let mut num_drafts = drafts.len();
            if !self.allocate_or_preempt(
                id,
                num_new,
                &mut num_drafts,
                &mut num_one_token_behind,
                &mut changes,
            )? {
                // `id` itself was preempted or ended: the running list shrank at `index`.
                continue;
            }
            step_drafts.extend_from_slice(&drafts[..num_drafts]);
            budget -= num_new + num_drafts;
            let seq = self.sequences.get_mut(id).expect("running");
            seq.num_computed_tokens += num_new;
            let caught_up = seq.num_computed_tokens == seq.num_tokens;
            num_partial_prefills += usize::from(!caught_up);
            scheduled.push(ScheduledSeq {
                id,
                request: seq.request,
                choice_index: seq.choice_index,
                start,
                num_tokens: num_new,
                num_drafts,
                num_samples: if caught_up { 1 + seq.num_pending_forks } else { 0 },
                is_decode: lacks_one && start >= seq.num_prompt_tokens,
                num_prompt_tokens: seq.num_prompt_tokens,
            });
            index += 1;
        }

        // NOTE: no admission in a step that preempted for want of blocks: the freed blocks go
        // to the running sequences first, or admission and preemption would chase each other.
        // Sequences requeued for the fair share freed seats for the others: admission goes on.
        if changes.preempted.len() == num_requeued_for_share {
            let mut admission =
                Admission { budget, num_partial_prefills, num_fork_seats, fair_share };
            self.admit_waiting(&mut admission, &mut scheduled, &mut changes)?;
        }

        let mut out = SchedulerOutput::for_sequences(&scheduled, block_size, self.kv.num_groups());
        out.preempted = changes.preempted;
        out.block_copies = changes.block_copies;
        self.last_logits_owners.clear();
        let mut next_draft = 0;
        for seq in &scheduled {
            let (token_ids, groups) = self.kv.tokens_and_groups(seq.id)?;
            let seq_drafts = &step_drafts[next_draft..next_draft + seq.num_drafts];
            next_draft += seq.num_drafts;
            out.push(seq, token_ids, seq_drafts, groups, block_size);
            if seq.num_samples > 0 {
                self.last_logits_owners.push(LogitsOwner {
                    id: seq.id,
                    num_rows: seq.num_samples + seq.num_drafts,
                    num_drafts: seq.num_drafts,
                });
            }
        }
        self.last_drafts = step_drafts;
        self.stats.step_num_prefill_tokens = out.num_prefill_tokens;
        self.stats.step_num_decode_tokens = out.num_decode_tokens;
        self.stats.num_prefill_tokens_total += out.num_prefill_tokens as u64;
        Ok(out)
    }

    /// Appends each sampled token (one per `logits_indices` row of the last schedule, in
    /// order) to its sequence, forks `n > 1` requests whose prompt just finished, applies
    /// stop conditions and frees what finished. Call it after every `schedule`, even an
    /// empty one: it also delivers sequences `schedule` ended on its own.
    ///
    /// A sequence that proposed tokens gets the longest prefix of its rows whose sampled
    /// token equals the proposal that row verifies, plus the next row's token (the
    /// correction, or the bonus row's), each checked against the stop conditions in turn.
    /// `draft_token_ids` replaces the proposals of the last schedule (all of them, in row
    /// order) when the caller wrote its own into the batch (`SpeculativeMethod::DraftModel`).
    ///
    /// Returns the sequences `schedule` ended (no token, no logits row) first, then one
    /// update per appended token, in logits-row order. A sequence aborted or finished by
    /// the caller since `schedule` gets nothing: its rows are dropped.
    pub fn update_from_output(&mut self, sampled_token_ids: &[u32]) -> Result<Vec<SequenceUpdate>> {
        self.update_from_output_with_drafts(sampled_token_ids, None)
    }

    /// `update_from_output`, with the caller's proposals (see there).
    pub fn update_from_output_with_drafts(
        &mut self,
        sampled_token_ids: &[u32],
        draft_token_ids: Option<&[u32]>,
    ) -> Result<Vec<SequenceUpdate>> {
        let num_rows: usize = self.last_logits_owners.iter().map(|owner| owner.num_rows).sum();
        if sampled_token_ids.len() != num_rows {
            return Err(Error::InvalidArgument(format!(
                "expected {num_rows} sampled tokens (one per logits row of the last schedule), \
                 got {}",
                sampled_token_ids.len()
            )));
        }
        let caller_proposes = self.spec.as_ref().is_some_and(SpecState::caller_proposes);
        if caller_proposes && draft_token_ids.is_none() && !self.last_drafts.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "the last schedule reserved {} slots for the caller's proposals (the \
                 draft_model method): pass them as draft_token_ids",
                self.last_drafts.len()
            )));
        }
        if let Some(drafts) = draft_token_ids {
            if drafts.len() != self.last_drafts.len() {
                return Err(Error::InvalidArgument(format!(
                    "expected {} draft tokens (the proposals of the last schedule), got {}",
                    self.last_drafts.len(),
                    drafts.len()
                )));
            }
            self.last_drafts.copy_from_slice(drafts);
        }
        let mut owners = std::mem::take(&mut self.last_logits_owners);
        let drafts = std::mem::take(&mut self.last_drafts);
        let mut updates = std::mem::take(&mut self.pending_updates);
        updates.reserve(owners.len());
        let mut next_row = 0;
        let mut next_draft = 0;
        let mut num_appended = 0;
        for &LogitsOwner { id, num_rows, num_drafts } in &owners {
            let first_row = next_row;
            next_row += num_rows;
            let seq_drafts = &drafts[next_draft..next_draft + num_drafts];
            next_draft += num_drafts;
            // A sequence aborted (or finished) since `schedule` drops its rows.
            if !self.sequences.contains(id) {
                continue;
            }
            if num_drafts > 0 {
                let rows = &sampled_token_ids[first_row..first_row + num_rows];
                num_appended +=
                    self.append_verified(id, rows, seq_drafts, first_row, &mut updates)?;
                continue;
            }
            // NOTE: fork before the parent's token is appended: the children start from
            // the prompt alone and take rows `first_row + 1..`, in choice order.
            let num_reserved = self.sequences[id].num_reserved_forks;
            let children = if num_rows > 1 { self.fork(id, num_rows - 1)? } else { Vec::new() };
            updates.push(self.append_token(id, sampled_token_ids[first_row], first_row)?);
            for (offset, child) in children.into_iter().enumerate() {
                let row = first_row + 1 + offset;
                updates.push(self.append_token(child, sampled_token_ids[row], row)?);
                // A choice past the seats its prompt reserved waits for one (the fair share).
                if offset >= num_reserved && self.sequences.contains(child) {
                    self.requeue(child)?;
                    self.stats.num_fair_share_requeues_total += 1;
                }
            }
            num_appended += num_rows;
        }
        self.stats.num_generated_tokens_total += num_appended as u64;
        // Keep the allocations for the next step.
        owners.clear();
        self.last_logits_owners = owners;
        Ok(updates)
    }

    /// Forks `num_forks` children off a sequence whose prompt was just computed; they share
    /// its blocks and sort right after it.
    fn fork(&mut self, parent: SequenceId, num_forks: usize) -> Result<Vec<SequenceId>> {
        let mut children = Vec::with_capacity(num_forks);
        for _ in 0..num_forks {
            let child = self.kv.fork(parent)?;
            let arrival_order = self.take_arrival_order();
            let mut seq = self.sequences[parent].clone();
            let request = self.requests.get_mut(seq.request).expect("live request");
            seq.id = child;
            seq.choice_index = request.choices.len();
            seq.num_pending_forks = 0;
            seq.num_reserved_forks = 0;
            seq.key.arrival_order = arrival_order;
            request.choices.push(child);
            let key = seq.key;
            self.sequences.insert(seq);
            if let Some(spec) = &mut self.spec {
                spec.fork(parent, child);
            }
            let position = self.running.partition_point(|other| self.sequences[*other].key < key);
            self.running.insert(position, child);
            children.push(child);
        }
        let seq = self.sequences.get_mut(parent).expect("live");
        seq.num_pending_forks = 0;
        seq.num_reserved_forks = 0;
        Ok(children)
    }

    /// Appends the token sampled from logits row `logits_row` to a sequence and ends it if
    /// a stop condition holds.
    fn append_token(
        &mut self,
        id: SequenceId,
        token: u32,
        logits_row: usize,
    ) -> Result<SequenceUpdate> {
        self.kv.append_token_ids(id, &[token])?;
        let max_model_len = self.config.max_model_len;
        let seq = self.sequences.get_mut(id).expect("live");
        seq.num_tokens += 1;
        let finish_reason =
            seq.stop.check(token, seq.num_output_tokens(), seq.num_tokens, max_model_len);
        let update = SequenceUpdate {
            request: seq.request,
            num_cached_tokens: self.requests[seq.request].reported_num_cached_tokens(),
            choice_index: seq.choice_index,
            new_token_id: Some(token),
            logits_row: Some(logits_row),
            finish_reason,
        };
        if finish_reason.is_some() {
            self.release(id)?;
        }
        Ok(update)
    }

    /// Ends a sequence that can never fit the KV cache, from `schedule`; the next
    /// `update_from_output` reports it.
    fn end_for_capacity(&mut self, id: SequenceId) -> Result<()> {
        let seq = &self.sequences[id];
        // A prompt that never ran to its end takes its forks-to-be with it: each of the
        // request's choices gets its own report.
        for choice_index in seq.choice_index..=seq.choice_index + seq.num_pending_forks {
            self.pending_updates.push(SequenceUpdate {
                request: seq.request,
                num_cached_tokens: self.requests[seq.request].reported_num_cached_tokens(),
                choice_index,
                new_token_id: None,
                logits_row: None,
                finish_reason: Some(FinishReason::Capacity),
            });
        }
        self.release(id)
    }

    /// Frees a finished sequence's blocks and forgets it (and its request once no choice
    /// is left). The one path that ends a sequence.
    fn release(&mut self, id: SequenceId) -> Result<()> {
        if let Some(spec) = &mut self.spec {
            let num_prompt_tokens = self.sequences[id].num_prompt_tokens;
            spec.release(id, &self.kv.token_ids(id)?[num_prompt_tokens..]);
        }
        self.kv.free(id)?;
        let seq = self.sequences.remove(id).expect("live");
        match seq.status {
            SequenceStatus::Running => self.running.retain(|&other| other != id),
            SequenceStatus::Waiting | SequenceStatus::Preempted => {
                self.waiting.remove(&seq.key);
            }
        }
        let request = self.requests.get_mut(seq.request).expect("live request");
        // Forks that will now never happen are finished along with their parent.
        request.num_live -= 1 + seq.num_pending_forks;
        if request.num_live == 0 {
            self.requests.remove(seq.request);
        }
        Ok(())
    }

    /// The next `QueueKey::arrival_order`.
    fn take_arrival_order(&mut self) -> u64 {
        let arrival_order = self.next_arrival_order;
        self.next_arrival_order += 1;
        arrival_order
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod simulation_tests;

#[cfg(test)]
mod fair_share_tests;

#[cfg(test)]
mod spec_tests;
