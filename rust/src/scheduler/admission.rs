//! Admission and preemption: who gets blocks this step, and who gives them up.
//!
//! Waiting sequences are admitted in queue order, each from its cached prefix, while the
//! step's budget, the sequence cap, the free blocks and the partial-prefill limit allow; the
//! first that does not fit stops admission (no overtaking). A running sequence that cannot
//! get a block takes them from the running sequence last in queue order (possibly itself),
//! which is requeued to recompute. While more than one request is live, a request holds
//! at most its fair share of the seats (`hold_fair_share`), and admission passes over the
//! waiting sequences of a request that holds it.

use std::collections::HashMap;
use std::ops::Bound::{Excluded, Unbounded};

use super::Scheduler;
use crate::batch::ScheduledSeq;
use crate::error::Result;
use crate::kv_cache_manager::{BlockCopy, SequenceId};
use crate::prefix_cache::BuildPrehashed;
use crate::sequence::{RequestHandle, SequenceStatus};

/// What building a batch changed besides the batch itself.
#[derive(Default)]
pub(super) struct StepChanges {
    /// Sequences preempted, in order.
    pub(super) preempted: Vec<SequenceId>,
    /// Copy-on-write copies for the runner.
    pub(super) block_copies: Vec<BlockCopy>,
}

/// What admission may still use this step.
pub(super) struct Admission {
    /// Tokens left in the step's budget.
    pub(super) budget: usize,
    /// Sequences whose prefill will still be unfinished after this step.
    pub(super) num_partial_prefills: usize,
    /// Seats held by running prompts for the choices they will fork into.
    pub(super) num_fork_seats: usize,
    /// The fair share in force this step (`None`: none applies).
    pub(super) fair_share: Option<FairShare>,
}

/// The fair share in force for a step: no request holds more than `share` seats.
pub(super) struct FairShare {
    /// `max_seqs_per_request`.
    pub(super) share: usize,
    /// Seats each request holds: its running sequences plus the forks their prompts
    /// reserved.
    pub(super) seats: HashMap<RequestHandle, usize, BuildPrehashed>,
}

impl Scheduler {
    /// Whether a running sequence lacks exactly one token: a decode, or the last token of a
    /// prefill. Either way one token that will be sampled from, and what the rule reserves
    /// budget (and a block) for.
    pub(super) fn lacks_one_token(&self, id: SequenceId) -> bool {
        let seq = &self.sequences[id];
        seq.num_tokens - seq.num_computed_tokens == 1
    }

    /// Tokens a sequence lacking `remaining` may compute within `budget`: a chunk of more
    /// than one token is also capped by `long_prefill_token_threshold`.
    pub(super) fn cap_chunk(&self, remaining: usize, budget: usize) -> usize {
        let mut num_new = remaining.min(budget);
        if remaining > 1 {
            if let Some(threshold) = self.config.long_prefill_token_threshold {
                num_new = num_new.min(threshold);
            }
        }
        num_new
    }

    /// Allocates `num_new` slots for running sequence `id`, preempting from the back of the
    /// running list until it fits. Returns false when `id` itself left the running list.
    /// Proposals (`num_drafts`) get slots only if they fit without a preemption; otherwise
    /// `num_drafts` drops to 0. `num_one_token_behind` (running sequences after `id` that
    /// lack one token) is kept up to date as they are preempted.
    pub(super) fn allocate_or_preempt(
        &mut self,
        id: SequenceId,
        num_new: usize,
        num_drafts: &mut usize,
        num_one_token_behind: &mut usize,
        changes: &mut StepChanges,
    ) -> Result<bool> {
        if *num_drafts > 0 {
            if let Some(copies) = self.kv.allocate_slots_with_drafts(id, num_new, *num_drafts)? {
                changes.block_copies.extend(copies);
                return Ok(true);
            }
            *num_drafts = 0;
        }
        loop {
            if let Some(copies) = self.kv.allocate_slots(id, num_new)? {
                changes.block_copies.extend(copies);
                return Ok(true);
            }
            let victim = *self.running.last().expect("id is running");
            if victim == id && self.running.len() == 1 {
                // Alone, with every other block free or evictable: it can never fit.
                self.end_for_capacity(id)?;
                return Ok(false);
            }
            if victim == id {
                self.preempt(victim)?;
                changes.preempted.push(victim);
                return Ok(false);
            }
            if self.lacks_one_token(victim) {
                *num_one_token_behind -= 1;
            }
            self.preempt(victim)?;
            changes.preempted.push(victim);
        }
    }

    /// Admits waiting sequences in queue order while they fit, passing over those whose
    /// request holds its fair share.
    pub(super) fn admit_waiting(
        &mut self,
        admission: &mut Admission,
        scheduled: &mut Vec<ScheduledSeq>,
        changes: &mut StepChanges,
    ) -> Result<()> {
        let mut next = self.waiting.first_key_value().map(|(&key, &id)| (key, id));
        while let Some((key, id)) = next {
            next = self.waiting.range((Excluded(key), Unbounded)).next().map(|(&k, &i)| (k, i));
            let seq = &self.sequences[id];
            let mut num_reserved = seq.num_pending_forks;
            if let Some(fair) = &admission.fair_share {
                let held = fair.seats.get(&seq.request).copied().unwrap_or(0);
                if held >= fair.share {
                    continue;
                }
                num_reserved = num_reserved.min(fair.share - held - 1);
            }
            let num_seats = 1 + num_reserved;
            let seats_in_use = self.running.len() + admission.num_fork_seats;
            if seats_in_use + num_seats > self.config.max_num_seqs || admission.budget == 0 {
                break;
            }
            // NOTE: a request that wants prompt logprobs needs the logits of every prompt
            // position, so it computes its whole prompt (its full blocks are still cached).
            let num_cached = if self.requests[seq.request].prompt_logprobs {
                0
            } else {
                self.kv.get_computed_blocks(id)?
            };
            let remaining = self.sequences[id].num_tokens - num_cached;
            let num_new = self.cap_chunk(remaining, admission.budget);
            let is_partial = num_new < remaining;
            if is_partial && admission.num_partial_prefills >= self.config.max_num_partial_prefills
            {
                break;
            }
            let Some(copies) = self.kv.allocate_slots(id, num_new)? else {
                if self.running.is_empty() {
                    // Every block is free and the first chunk still does not fit.
                    self.end_for_capacity(id)?;
                    continue;
                }
                break;
            };
            changes.block_copies.extend(copies);
            self.waiting.remove(&key);
            admission.budget -= num_new;
            admission.num_partial_prefills += usize::from(is_partial);
            admission.num_fork_seats += num_reserved;
            let seq = self.sequences.get_mut(id).expect("waiting");
            if let Some(fair) = &mut admission.fair_share {
                *fair.seats.entry(seq.request).or_insert(0) += num_seats;
            }
            seq.status = SequenceStatus::Running;
            seq.num_reserved_forks = num_reserved;
            seq.num_computed_tokens = num_cached + num_new;
            // NOTE: set once, as vLLM reports it: a preempted sequence that finds its
            // prefix again when it is readmitted does not change it.
            let request = self.requests.get_mut(seq.request).expect("live request");
            request.num_cached_tokens.get_or_insert(num_cached);
            scheduled.push(ScheduledSeq {
                id,
                request: seq.request,
                choice_index: seq.choice_index,
                start: num_cached,
                num_tokens: num_new,
                num_drafts: 0,
                num_samples: if is_partial { 0 } else { 1 + seq.num_pending_forks },
                is_decode: false,
                num_prompt_tokens: seq.num_prompt_tokens,
            });
            let position = self.running.partition_point(|other| self.sequences[*other].key < key);
            self.running.insert(position, id);
        }
        Ok(())
    }

    /// Frees a running sequence's blocks and requeues it, tokens kept, to recompute, for
    /// want of blocks.
    pub(super) fn preempt(&mut self, id: SequenceId) -> Result<()> {
        self.requeue(id)?;
        self.sequences.get_mut(id).expect("requeued").num_preemptions += 1;
        self.stats.num_preemptions_total += 1;
        Ok(())
    }

    /// Frees a running sequence's blocks and requeues it, tokens kept, to recompute.
    pub(super) fn requeue(&mut self, id: SequenceId) -> Result<()> {
        self.kv.reset(id)?;
        let seq = self.sequences.get_mut(id).expect("running");
        seq.status = SequenceStatus::Preempted;
        seq.num_computed_tokens = 0;
        seq.num_reserved_forks = 0;
        let key = seq.key;
        self.running.retain(|&other| other != id);
        self.waiting.insert(key, id);
        Ok(())
    }

    /// Puts the fair share in force when more than one request is live: a request over it
    /// gives back the seats its prompt reserved for forks, then its running sequences,
    /// last in queue order first (each requeued to recompute; the requeued count in
    /// `num_fair_share_requeues_total`). Returns the share with the seats each request
    /// holds after, or `None` when no share applies.
    pub(super) fn hold_fair_share(
        &mut self,
        changes: &mut StepChanges,
    ) -> Result<Option<FairShare>> {
        let Some(share) = self.config.max_seqs_per_request else {
            return Ok(None);
        };
        if self.requests.len() < 2 {
            return Ok(None);
        }
        let mut seats: HashMap<RequestHandle, usize, BuildPrehashed> = HashMap::default();
        let mut over = false;
        for &id in &self.running {
            let seq = &self.sequences[id];
            let held = seats.entry(seq.request).or_insert(0);
            *held += 1 + seq.num_reserved_forks;
            over |= *held > share;
        }
        let mut index = self.running.len();
        while over && index > 0 {
            index -= 1;
            let id = self.running[index];
            let seq = self.sequences.get_mut(id).expect("running");
            let held = seats.get_mut(&seq.request).expect("counted above");
            if *held <= share {
                continue;
            }
            let given_back = seq.num_reserved_forks.min(*held - share);
            seq.num_reserved_forks -= given_back;
            *held -= given_back;
            if *held > share {
                *held -= 1 + seq.num_reserved_forks;
                self.requeue(id)?;
                changes.preempted.push(id);
                self.stats.num_fair_share_requeues_total += 1;
            }
        }
        Ok(Some(FairShare { share, seats }))
    }
}
