//! The per-iteration scheduler: continuous batching, chunked prefill, preemption.
//!
//! It owns every request and the `KVCacheManager`. Each step the caller runs:
//! `schedule()` (which sequences compute how many tokens), the model, then
//! `update_from_output(sampled)` (append the sampled tokens, apply stop conditions, free
//! what finished). Requests may be added, aborted or finished between steps.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::batch::{RequestUpdate, ScheduledSeq, SchedulerOutput};
pub use crate::config::{RequestParams, SchedulerConfig, SchedulingPolicy};
use crate::error::{Error, Result};
use crate::kv_cache_manager::{BlockCopy, KVCacheManager, RequestId};
use crate::metrics::SchedulerStats;
use crate::prefix_cache::BuildPrehashed;
use crate::request::{FinishReason, QueueKey, Request, RequestStatus, RequestTable};

/// What building a batch changed besides the batch itself.
#[derive(Default)]
struct StepChanges {
    /// Sequences preempted, in order.
    preempted: Vec<RequestId>,
    /// Copy-on-write copies for the runner.
    block_copies: Vec<BlockCopy>,
}

/// What admission may still use this step.
struct Admission {
    /// Tokens left in the step's budget.
    budget: usize,
    /// Sequences whose prefill will still be unfinished after this step.
    num_partial_prefills: usize,
    /// Seats held by running prompts for the choices they will fork into.
    num_fork_seats: usize,
}

/// A caller's request: one id, `n` sequences once its prompt is computed.
#[derive(Debug, Clone)]
struct Group {
    /// The caller's id.
    external_id: Arc<str>,
    /// Sequences by choice index (just the first until the prompt is computed).
    members: Vec<RequestId>,
    /// Sequences not finished, plus forks still to come.
    num_live: usize,
}

/// The scheduler.
#[derive(Debug)]
pub struct Scheduler {
    /// Sizes and limits.
    config: SchedulerConfig,
    /// Blocks of every sequence.
    kv: KVCacheManager,
    /// Every live sequence.
    requests: RequestTable,
    /// Running sequences sorted by queue key: scheduled from the front, preempted from the
    /// back.
    running: Vec<RequestId>,
    /// Waiting and preempted sequences in admission order.
    waiting: BTreeMap<QueueKey, RequestId>,
    /// Live caller requests by handle.
    groups: HashMap<u64, Group, BuildPrehashed>,
    /// Caller ids of live requests to their handle.
    external_id_to_group: HashMap<Arc<str>, u64>,
    /// Sequences of the last schedule that sample, with their number of logits rows (1,
    /// or `n` for a prompt that forks), in row order.
    last_logits_owners: Vec<(RequestId, usize)>,
    /// Sequences `schedule` ended on its own (capacity), delivered by the next
    /// `update_from_output`. Finishes the caller decided (aborts, stop strings) are not
    /// queued: the caller already knows.
    pending_updates: Vec<RequestUpdate>,
    /// Next group handle.
    next_group: u64,
    /// Next queue sequence number.
    next_sequence: u64,
    /// Counters.
    stats: SchedulerStats,
}

impl Scheduler {
    /// A scheduler with an empty queue and a free KV cache.
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        config.validate()?;
        let kv = KVCacheManager::new(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            &config.namespace,
        )?;
        Ok(Scheduler {
            config,
            kv,
            requests: RequestTable::default(),
            running: Vec::new(),
            waiting: BTreeMap::new(),
            groups: HashMap::default(),
            external_id_to_group: HashMap::new(),
            last_logits_owners: Vec::new(),
            pending_updates: Vec::new(),
            next_group: 0,
            next_sequence: 0,
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

    /// Queues a request. Returns its handle (as used in `RequestUpdate::group`).
    pub fn add_request(
        &mut self,
        external_id: &str,
        prompt_token_ids: &[u32],
        params: RequestParams,
    ) -> Result<u64> {
        if self.external_id_to_group.contains_key(external_id) {
            return Err(Error::DuplicateRequest(external_id.to_owned()));
        }
        let num_prompt_tokens = prompt_token_ids.len();
        if num_prompt_tokens > self.config.max_model_len {
            return Err(Error::InvalidArgument(format!(
                "the prompt has {num_prompt_tokens} tokens but max_model_len is {}",
                self.config.max_model_len
            )));
        }
        if params.n == 0 || params.n > self.config.max_num_seqs {
            return Err(Error::InvalidArgument(format!(
                "n must be between 1 and max_num_seqs ({}), got {}",
                self.config.max_num_seqs, params.n
            )));
        }
        if params.stop.max_tokens == 0 {
            return Err(Error::InvalidArgument("max_tokens must be at least 1".into()));
        }
        if params.stop.min_tokens > params.stop.max_tokens {
            return Err(Error::InvalidArgument(format!(
                "min_tokens ({}) must be <= max_tokens ({})",
                params.stop.min_tokens, params.stop.max_tokens
            )));
        }
        let id = self.kv.add_request(prompt_token_ids, params.cache_salt.as_deref())?;
        let sequence = self.take_sequence();
        let key = QueueKey {
            priority: match self.config.policy {
                SchedulingPolicy::Fcfs => 0,
                SchedulingPolicy::Priority => params.priority,
            },
            arrival_time: params.arrival_time.unwrap_or(sequence as f64),
            sequence,
        };
        let group = self.next_group;
        self.next_group += 1;
        let external_id: Arc<str> = Arc::from(external_id);
        self.groups.insert(
            group,
            Group { external_id: external_id.clone(), members: vec![id], num_live: params.n },
        );
        self.external_id_to_group.insert(external_id, group);
        self.requests.insert(Request {
            id,
            group,
            choice_index: 0,
            num_pending_forks: params.n - 1,
            key,
            status: RequestStatus::Waiting,
            num_prompt_tokens,
            num_tokens: num_prompt_tokens,
            num_computed_tokens: 0,
            stop: params.stop,
            num_preemptions: 0,
        });
        self.waiting.insert(key, id);
        Ok(group)
    }

    /// Ends a request and all its choices now, in whatever state, freeing every block.
    pub fn abort_request(&mut self, external_id: &str) -> Result<()> {
        let group = self.group_of(external_id)?;
        let members = self.groups[&group].members.clone();
        for id in members {
            if self.requests.contains(id) {
                self.release(id)?;
            }
        }
        // Forks that never happened die with the group, and so does news of choices
        // `schedule` ended: nothing about an aborted request is reported any more.
        self.remove_group(group);
        self.pending_updates.retain(|update| update.group != group);
        Ok(())
    }

    /// Ends one choice of a request for a reason decided outside the core (a stop string),
    /// freeing its blocks. Not reported back by `update_from_output`: the caller decided it.
    pub fn finish_request(&mut self, external_id: &str, choice_index: usize) -> Result<()> {
        let id = self.live_choice(external_id, choice_index)?;
        self.release(id)
    }

    /// Where one choice of a live request is: waiting, running or preempted.
    pub fn status(&self, external_id: &str, choice_index: usize) -> Result<RequestStatus> {
        let id = self.live_choice(external_id, choice_index)?;
        Ok(self.requests[id].status)
    }

    /// The sequence of one live choice of a live request.
    fn live_choice(&self, external_id: &str, choice_index: usize) -> Result<RequestId> {
        let group = self.group_of(external_id)?;
        self.groups[&group]
            .members
            .get(choice_index)
            .copied()
            .filter(|&id| self.requests.contains(id))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "request {external_id:?} has no live choice {choice_index}"
                ))
            })
    }

    /// The handle of a live request.
    pub fn group(&self, external_id: &str) -> Option<u64> {
        self.external_id_to_group.get(external_id).copied()
    }

    /// The caller's id of a request handle, while the request is live.
    pub fn external_id(&self, group: u64) -> Option<&Arc<str>> {
        self.groups.get(&group).map(|g| &g.external_id)
    }

    /// The caller's request handle and choice index of a live sequence.
    pub fn sequence_of(&self, id: RequestId) -> Option<(u64, usize)> {
        self.requests.get(id).map(|request| (request.group, request.choice_index))
    }

    /// Whether any request is waiting or running.
    pub fn has_unfinished_requests(&self) -> bool {
        !self.requests.is_empty() || !self.pending_updates.is_empty()
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
                .filter(|&&id| self.requests[id].status == RequestStatus::Preempted)
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
    /// decode token, or its next prefill chunk (capped by `long_prefill_token_threshold`,
    /// and leaving one token of budget for every decode behind it, so a long prompt never
    /// starves the decodes). Then waiting sequences are admitted in queue order, starting
    /// from their cached prefix, while budget, cap, free blocks and the partial-prefill
    /// limit allow; the first that does not fit stops admission. When a running sequence
    /// cannot get a block, the running sequence last in queue order is preempted (its
    /// blocks freed, requeued to recompute), possibly itself. A sequence that cannot fit
    /// even alone ends with `FinishReason::Capacity`.
    pub fn schedule(&mut self) -> Result<SchedulerOutput> {
        let block_size = self.config.block_size;
        let mut budget = self.config.max_num_batched_tokens;
        let mut scheduled: Vec<ScheduledSeq> = Vec::with_capacity(self.running.len());
        let mut changes = StepChanges::default();
        let mut num_decodes_behind = 0;
        // A prompt with n > 1 holds a seat for each choice it will fork into.
        let mut num_fork_seats = 0;
        for id in &self.running {
            num_decodes_behind += usize::from(self.is_decode(id));
            num_fork_seats += self.requests[*id].num_pending_forks;
        }
        let mut num_partial_prefills = 0;

        let mut index = 0;
        while index < self.running.len() {
            let id = self.running[index];
            let request = &self.requests[id];
            let start = request.num_computed_tokens;
            let remaining = request.num_tokens - start;
            let is_decode = remaining == 1;
            if is_decode {
                num_decodes_behind -= 1;
            }
            let reserved = if is_decode { 0 } else { num_decodes_behind };
            let num_new = self.cap_chunk(remaining, budget.saturating_sub(reserved), is_decode);
            if num_new == 0 {
                num_partial_prefills += usize::from(remaining > 0);
                index += 1;
                continue;
            }
            if !self.allocate_or_preempt(id, num_new, &mut num_decodes_behind, &mut changes)? {
                // `id` itself was preempted or ended: the running list shrank at `index`.
                continue;
            }
            budget -= num_new;
            let request = self.requests.get_mut(id).expect("running");
            request.num_computed_tokens += num_new;
            let caught_up = request.num_computed_tokens == request.num_tokens;
            num_partial_prefills += usize::from(!caught_up);
            scheduled.push(ScheduledSeq {
                id,
                group: request.group,
                choice_index: request.choice_index,
                start,
                num_tokens: num_new,
                num_samples: if caught_up { 1 + request.num_pending_forks } else { 0 },
                is_decode: is_decode && start >= request.num_prompt_tokens,
            });
            index += 1;
        }

        // NOTE: no admission in a step that preempted: the freed blocks go to the running
        // sequences first, or admission and preemption would chase each other.
        if changes.preempted.is_empty() {
            let mut admission = Admission { budget, num_partial_prefills, num_fork_seats };
            self.admit_waiting(&mut admission, &mut scheduled, &mut changes)?;
        }

        let mut out = SchedulerOutput::for_sequences(&scheduled, block_size);
        out.preempted = changes.preempted;
        out.block_copies = changes.block_copies;
        self.last_logits_owners.clear();
        for seq in &scheduled {
            let (token_ids, block_table) = self.kv.tokens_and_blocks(seq.id)?;
            out.push(seq, token_ids, block_table, block_size);
            if seq.num_samples > 0 {
                self.last_logits_owners.push((seq.id, seq.num_samples));
            }
        }
        self.stats.step_num_prefill_tokens = out.num_prefill_tokens;
        self.stats.step_num_decode_tokens = out.num_decode_tokens;
        self.stats.num_prefill_tokens_total += out.num_prefill_tokens as u64;
        Ok(out)
    }

    /// Appends each sampled token (one per `logits_indices` row of the last schedule, in
    /// order) to its sequence, forks `n > 1` requests whose prompt just finished, applies
    /// stop conditions and frees what finished. Call it after every `schedule`, even an
    /// empty one: it also delivers requests `schedule` ended on its own.
    ///
    /// Returns those requests first (no token, no logits row), then one update per
    /// sequence that got a token, in logits-row order. A sequence aborted or finished by
    /// the caller since `schedule` gets nothing: its rows are dropped.
    pub fn update_from_output(&mut self, sampled_token_ids: &[u32]) -> Result<Vec<RequestUpdate>> {
        let num_rows: usize = self.last_logits_owners.iter().map(|&(_, rows)| rows).sum();
        if sampled_token_ids.len() != num_rows {
            return Err(Error::InvalidArgument(format!(
                "expected {num_rows} sampled tokens (one per logits row of the last schedule), \
                 got {}",
                sampled_token_ids.len()
            )));
        }
        let mut owners = std::mem::take(&mut self.last_logits_owners);
        let mut updates = std::mem::take(&mut self.pending_updates);
        updates.reserve(owners.len());
        let mut next_row = 0;
        for &(id, num_rows) in &owners {
            let first_row = next_row;
            next_row += num_rows;
            // A sequence aborted (or finished) since `schedule` drops its rows.
            if !self.requests.contains(id) {
                continue;
            }
            // NOTE: fork before the parent's token is appended: the children start from
            // the prompt alone and take rows `first_row + 1..`, in choice order.
            let children = if num_rows > 1 { self.fork(id, num_rows - 1)? } else { Vec::new() };
            updates.push(self.append_token(id, sampled_token_ids[first_row], first_row)?);
            for (offset, child) in children.into_iter().enumerate() {
                let row = first_row + 1 + offset;
                updates.push(self.append_token(child, sampled_token_ids[row], row)?);
            }
        }
        self.stats.num_generated_tokens_total += sampled_token_ids.len() as u64;
        // Keep the allocation for the next step.
        owners.clear();
        self.last_logits_owners = owners;
        Ok(updates)
    }

    /// Whether a running sequence lacks exactly one token (a decode, or the last token of
    /// a prefill: either way one token that will be sampled from).
    fn is_decode(&self, id: &RequestId) -> bool {
        let request = &self.requests[*id];
        request.num_tokens - request.num_computed_tokens == 1
    }

    /// Tokens a sequence lacking `remaining` may compute within `budget`.
    fn cap_chunk(&self, remaining: usize, budget: usize, is_decode: bool) -> usize {
        let mut num_new = remaining.min(budget);
        if !is_decode {
            if let Some(threshold) = self.config.long_prefill_token_threshold {
                num_new = num_new.min(threshold);
            }
        }
        num_new
    }

    /// Allocates `num_new` slots for running sequence `id`, preempting from the back of the
    /// running list until it fits. Returns false when `id` itself left the running list.
    fn allocate_or_preempt(
        &mut self,
        id: RequestId,
        num_new: usize,
        num_decodes_behind: &mut usize,
        changes: &mut StepChanges,
    ) -> Result<bool> {
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
            if self.is_decode(&victim) {
                *num_decodes_behind -= 1;
            }
            self.preempt(victim)?;
            changes.preempted.push(victim);
        }
    }

    /// Admits waiting sequences in queue order while they fit.
    fn admit_waiting(
        &mut self,
        admission: &mut Admission,
        scheduled: &mut Vec<ScheduledSeq>,
        changes: &mut StepChanges,
    ) -> Result<()> {
        while let Some((&key, &id)) = self.waiting.first_key_value() {
            let num_seats = 1 + self.requests[id].num_pending_forks;
            let seats_in_use = self.running.len() + admission.num_fork_seats;
            if seats_in_use + num_seats > self.config.max_num_seqs || admission.budget == 0 {
                break;
            }
            let num_cached = self.kv.get_computed_blocks(id)?;
            let remaining = self.requests[id].num_tokens - num_cached;
            let num_new = self.cap_chunk(remaining, admission.budget, false);
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
            admission.num_fork_seats += num_seats - 1;
            let request = self.requests.get_mut(id).expect("waiting");
            request.status = RequestStatus::Running;
            request.num_computed_tokens = num_cached + num_new;
            scheduled.push(ScheduledSeq {
                id,
                group: request.group,
                choice_index: request.choice_index,
                start: num_cached,
                num_tokens: num_new,
                num_samples: if is_partial { 0 } else { num_seats },
                is_decode: false,
            });
            let position = self.running.partition_point(|other| self.requests[*other].key < key);
            self.running.insert(position, id);
        }
        Ok(())
    }

    /// Frees a running sequence's blocks and requeues it, tokens kept, to recompute.
    fn preempt(&mut self, id: RequestId) -> Result<()> {
        self.kv.reset(id)?;
        let request = self.requests.get_mut(id).expect("running");
        request.status = RequestStatus::Preempted;
        request.num_computed_tokens = 0;
        request.num_preemptions += 1;
        let key = request.key;
        self.running.retain(|&other| other != id);
        self.waiting.insert(key, id);
        self.stats.num_preemptions_total += 1;
        Ok(())
    }

    /// Forks `num_forks` children off a sequence whose prompt was just computed; they share
    /// its blocks and sort right after it.
    fn fork(&mut self, parent: RequestId, num_forks: usize) -> Result<Vec<RequestId>> {
        let mut children = Vec::with_capacity(num_forks);
        for _ in 0..num_forks {
            let child = self.kv.fork(parent)?;
            let sequence = self.take_sequence();
            let mut request = self.requests[parent].clone();
            let group = self.groups.get_mut(&request.group).expect("live group");
            request.id = child;
            request.choice_index = group.members.len();
            request.num_pending_forks = 0;
            request.key.sequence = sequence;
            group.members.push(child);
            let key = request.key;
            self.requests.insert(request);
            let position = self.running.partition_point(|other| self.requests[*other].key < key);
            self.running.insert(position, child);
            children.push(child);
        }
        self.requests.get_mut(parent).expect("live").num_pending_forks = 0;
        Ok(children)
    }

    /// Appends the token sampled from logits row `logits_row` to a sequence and ends it if
    /// a stop condition holds.
    fn append_token(
        &mut self,
        id: RequestId,
        token: u32,
        logits_row: usize,
    ) -> Result<RequestUpdate> {
        self.kv.append_token_ids(id, &[token])?;
        let max_model_len = self.config.max_model_len;
        let request = self.requests.get_mut(id).expect("live");
        request.num_tokens += 1;
        let finish_reason = request.stop.check(
            token,
            request.num_output_tokens(),
            request.num_tokens,
            max_model_len,
        );
        let update = RequestUpdate {
            group: request.group,
            choice_index: request.choice_index,
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
    fn end_for_capacity(&mut self, id: RequestId) -> Result<()> {
        let request = &self.requests[id];
        self.pending_updates.push(RequestUpdate {
            group: request.group,
            choice_index: request.choice_index,
            new_token_id: None,
            logits_row: None,
            finish_reason: Some(FinishReason::Capacity),
        });
        self.release(id)
    }

    /// Frees a finished sequence's blocks and forgets it (and its group once empty).
    fn release(&mut self, id: RequestId) -> Result<()> {
        self.kv.free(id)?;
        let request = self.requests.remove(id).expect("live");
        match request.status {
            RequestStatus::Running => self.running.retain(|&other| other != id),
            RequestStatus::Waiting | RequestStatus::Preempted => {
                self.waiting.remove(&request.key);
            }
        }
        let group = self.groups.get_mut(&request.group).expect("live group");
        // Forks that will now never happen are finished along with their parent.
        group.num_live -= 1 + request.num_pending_forks;
        if group.num_live == 0 {
            self.remove_group(request.group);
        }
        Ok(())
    }

    fn remove_group(&mut self, group: u64) {
        if let Some(removed) = self.groups.remove(&group) {
            self.external_id_to_group.remove(&removed.external_id);
        }
    }

    fn group_of(&self, external_id: &str) -> Result<u64> {
        self.group(external_id).ok_or_else(|| Error::UnknownRequest(external_id.to_owned()))
    }

    fn take_sequence(&mut self) -> u64 {
        let sequence = self.next_sequence;
        self.next_sequence += 1;
        sequence
    }
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
