//! The per-iteration scheduler: continuous batching, chunked prefill, preemption.
//!
//! It owns every request and the `KVCacheManager`. A caller's *request* (one id, `n`
//! choices) runs as `n` *sequences*, one per choice; the scheduler batches sequences. Each
//! step the caller runs: `schedule()` (which sequences compute how many tokens), the model,
//! then `update_from_output(sampled)` (append the sampled tokens, apply stop conditions,
//! free what finished). Requests may be added, aborted or finished between steps.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::batch::{ScheduledSeq, SchedulerOutput, SequenceUpdate};
pub use crate::config::{RequestParams, SchedulerConfig, SchedulingPolicy};
use crate::error::{Error, Result};
use crate::kv_cache_manager::{BlockCopy, KVCacheManager, SequenceId};
use crate::metrics::SchedulerStats;
use crate::prefix_cache::BuildPrehashed;
use crate::sequence::{FinishReason, QueueKey, Sequence, SequenceStatus, SequenceTable};
use crate::speculative::{Drafter, SpeculativeMethod, SuffixCache};

/// Most decode steps a sequence sits out after proposals that all failed (see
/// `append_verified`).
const MAX_SPEC_COOLDOWN: u32 = 15;

/// What building a batch changed besides the batch itself.
#[derive(Default)]
struct StepChanges {
    /// Sequences preempted, in order.
    preempted: Vec<SequenceId>,
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

/// A caller's request: one id, `n` sequences once its prompt is computed.
#[derive(Debug, Clone)]
struct Request {
    /// The caller's id.
    external_id: Arc<str>,
    /// Its sequences by choice index (just the first until the prompt is computed).
    choices: Vec<SequenceId>,
    /// Sequences not finished, plus forks still to come.
    num_live: usize,
    /// Prompt tokens served from the prefix cache, found when its first sequence was first
    /// scheduled (`None` until then). Preemption and recomputation leave it as it is.
    num_cached_tokens: Option<usize>,
}

impl Request {
    /// `num_cached_tokens` as reported: 0 for a request never scheduled.
    fn reported_num_cached_tokens(&self) -> usize {
        self.num_cached_tokens.unwrap_or(0)
    }
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
    /// Live caller requests by handle.
    requests: HashMap<u64, Request, BuildPrehashed>,
    /// Caller ids of live requests to their handle.
    external_id_to_request: HashMap<Arc<str>, u64>,
    /// Sequences of the last schedule that sample, in row order.
    last_logits_owners: Vec<LogitsOwner>,
    /// Proposals of the last schedule, in row order (`LogitsOwner::num_drafts` each).
    last_drafts: Vec<u32>,
    /// Outputs of recently finished sequences (suffix speculation).
    suffix_cache: Option<SuffixCache>,
    /// Sequences `schedule` ended on its own (capacity), delivered by the next
    /// `update_from_output`. Finishes the caller decided (aborts, stop strings) are not
    /// queued: the caller already knows.
    pending_updates: Vec<SequenceUpdate>,
    /// Handle of the next request added.
    next_request_handle: u64,
    /// `QueueKey::arrival_order` of the next sequence queued (added or forked).
    next_arrival_order: u64,
    /// Counters.
    stats: SchedulerStats,
}

impl Scheduler {
    /// A scheduler with an empty queue and a free KV cache.
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        config.validate()?;
        let suffix_cache = match config.speculative.as_ref().map(|spec| &spec.method) {
            Some(&SpeculativeMethod::Suffix { max_depth, max_cached_requests, .. }) => {
                Some(SuffixCache::new(max_depth, max_cached_requests))
            }
            _ => None,
        };
        let kv = KVCacheManager::new(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            &config.namespace,
        )?;
        Ok(Scheduler {
            config,
            kv,
            sequences: SequenceTable::default(),
            running: Vec::new(),
            waiting: BTreeMap::new(),
            requests: HashMap::default(),
            external_id_to_request: HashMap::new(),
            last_logits_owners: Vec::new(),
            last_drafts: Vec::new(),
            suffix_cache,
            pending_updates: Vec::new(),
            next_request_handle: 0,
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

    /// Queues a request. Returns its handle (as used in `SequenceUpdate::request`).
    ///
    /// The length rule, stated here once: a sequence (prompt and output together) holds at
    /// most `max_model_len` tokens and generates at least one, so a prompt may have up to
    /// `max_model_len - 1` tokens; generation ends with `FinishReason::Length` when the
    /// sequence reaches `max_model_len` tokens.
    pub fn add_request(
        &mut self,
        external_id: &str,
        prompt_token_ids: &[u32],
        params: RequestParams,
    ) -> Result<u64> {
        if self.external_id_to_request.contains_key(external_id) {
            return Err(Error::DuplicateRequest(external_id.to_owned()));
        }
        let num_prompt_tokens = prompt_token_ids.len();
        if num_prompt_tokens >= self.config.max_model_len {
            return Err(Error::InvalidArgument(format!(
                "the prompt has {num_prompt_tokens} tokens; max_model_len is {} (prompt and \
                 output together, at least one output token)",
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
        let id = self.kv.add_sequence(prompt_token_ids, params.cache_salt.as_deref())?;
        let arrival_order = self.take_arrival_order();
        let key = QueueKey {
            priority: match self.config.policy {
                SchedulingPolicy::Fcfs => 0,
                SchedulingPolicy::Priority => params.priority,
            },
            arrival_time: params.arrival_time.unwrap_or(arrival_order as f64),
            arrival_order,
        };
        let handle = self.next_request_handle;
        self.next_request_handle += 1;
        let external_id: Arc<str> = Arc::from(external_id);
        let request = Request {
            external_id: external_id.clone(),
            choices: vec![id],
            num_live: params.n,
            num_cached_tokens: None,
        };
        self.requests.insert(handle, request);
        self.external_id_to_request.insert(external_id, handle);
        self.sequences.insert(Sequence {
            id,
            request: handle,
            choice_index: 0,
            num_pending_forks: params.n - 1,
            key,
            status: SequenceStatus::Waiting,
            num_prompt_tokens,
            num_tokens: num_prompt_tokens,
            num_computed_tokens: 0,
            stop: params.stop,
            num_preemptions: 0,
            drafter: match &self.config.speculative {
                Some(spec) if params.speculate => Some(Drafter::new(&spec.method)),
                _ => None,
            },
            num_spec_misses: 0,
            spec_cooldown: 0,
            spec_len: self
                .config
                .speculative
                .as_ref()
                .map_or(0, |spec| spec.num_speculative_tokens),
        });
        self.waiting.insert(key, id);
        Ok(handle)
    }

    /// Ends a request and all its choices now, in whatever state, freeing every block.
    pub fn abort_request(&mut self, external_id: &str) -> Result<()> {
        let handle = self.handle_of(external_id)?;
        let choices = self.requests[&handle].choices.clone();
        for id in choices {
            if self.sequences.contains(id) {
                self.release(id)?;
            }
        }
        // Forks that never happened die with the request, and so does news of choices
        // `schedule` ended: nothing about an aborted request is reported any more.
        self.remove_request(handle);
        self.pending_updates.retain(|update| update.request != handle);
        Ok(())
    }

    /// Ends one choice of a request for a reason decided outside the core (a stop string),
    /// freeing its blocks. Not reported back by `update_from_output`: the caller decided it.
    pub fn finish_request(&mut self, external_id: &str, choice_index: usize) -> Result<()> {
        let id = self.live_choice(external_id, choice_index)?;
        self.release(id)
    }

    /// Where one choice of a live request is: waiting, running or preempted.
    pub fn status(&self, external_id: &str, choice_index: usize) -> Result<SequenceStatus> {
        let id = self.live_choice(external_id, choice_index)?;
        Ok(self.sequences[id].status)
    }

    /// The sequence of one live choice of a live request.
    fn live_choice(&self, external_id: &str, choice_index: usize) -> Result<SequenceId> {
        let handle = self.handle_of(external_id)?;
        self.requests[&handle]
            .choices
            .get(choice_index)
            .copied()
            .filter(|&id| self.sequences.contains(id))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "request {external_id:?} has no live choice {choice_index}"
                ))
            })
    }

    /// The handle of a live request.
    pub fn request_handle(&self, external_id: &str) -> Option<u64> {
        self.external_id_to_request.get(external_id).copied()
    }

    /// The caller's id of a request handle, while the request is live.
    pub fn external_id(&self, handle: u64) -> Option<&Arc<str>> {
        self.requests.get(&handle).map(|request| &request.external_id)
    }

    /// Prompt tokens of a live request served from the prefix cache when it was first
    /// scheduled (`None` until then).
    pub fn num_cached_tokens(&self, handle: u64) -> Option<usize> {
        self.requests.get(&handle)?.num_cached_tokens
    }

    /// The caller's request handle and choice index of a live sequence.
    pub fn sequence_of(&self, id: SequenceId) -> Option<(u64, usize)> {
        self.sequences.get(id).map(|seq| (seq.request, seq.choice_index))
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
    /// decode token, or its next prefill chunk (capped by `long_prefill_token_threshold`,
    /// and leaving one token of budget for every decode behind it, so a long prompt never
    /// starves the decodes). Then waiting sequences are admitted in queue order, starting
    /// from their cached prefix, while budget, cap, free blocks and the partial-prefill
    /// limit allow; the first that does not fit stops admission. When a running sequence
    /// cannot get a block, the running sequence last in queue order is preempted (its
    /// blocks freed, requeued to recompute), possibly itself. A sequence that cannot fit
    /// even alone ends with `FinishReason::Capacity`.
    ///
    /// With speculative decoding, a sequence decoding an output token also proposes up to
    /// `k` tokens after it (see `speculative`), within the budget left after one token for
    /// every decode behind it; proposals never cause a preemption (a sequence that cannot get
    /// their slots, or whose proposals would take the block a decode behind it needs,
    /// decodes without them), no sequence proposes in a step that runs
    /// `disable_by_batch_size` sequences or more, and a sequence proposes about as many
    /// tokens as it had accepted last time, less and less often while none are.
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
            num_fork_seats += self.sequences[*id].num_pending_forks;
        }
        let mut num_partial_prefills = 0;
        let speculating = self.config.speculative.as_ref().is_some_and(|spec| {
            spec.disable_by_batch_size.is_none_or(|limit| self.running.len() < limit)
        });
        let mut drafts: Vec<u32> = Vec::new();
        let mut step_drafts: Vec<u32> = Vec::new();

        let mut index = 0;
        while index < self.running.len() {
            let id = self.running[index];
            let seq = &self.sequences[id];
            let start = seq.num_computed_tokens;
            let remaining = seq.num_tokens - start;
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
            drafts.clear();
            if speculating && is_decode {
                // Every decode behind still gets its token, and its block (`num_free_blocks`
                // counts evictable ones): proposals take only what is left of both.
                let room = budget.saturating_sub(num_new + num_decodes_behind);
                self.propose(id, room, &mut drafts)?;
                let end = start + num_new;
                let num_draft_blocks =
                    (end + drafts.len()).div_ceil(block_size) - end.div_ceil(block_size);
                if num_draft_blocks + 1 + num_decodes_behind > self.kv.num_free_blocks() {
                    drafts.clear();
                }
            }
            let mut num_drafts = drafts.len();
            if !self.allocate_or_preempt(
                id,
                num_new,
                &mut num_drafts,
                &mut num_decodes_behind,
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
                is_decode: is_decode && start >= seq.num_prompt_tokens,
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
        let mut next_draft = 0;
        for seq in &scheduled {
            let (token_ids, block_table) = self.kv.tokens_and_blocks(seq.id)?;
            let seq_drafts = &step_drafts[next_draft..next_draft + seq.num_drafts];
            next_draft += seq.num_drafts;
            out.push(seq, token_ids, seq_drafts, block_table, block_size);
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
    /// order) when the caller wrote its own into the batch (`SpeculativeMethod::External`).
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
        let external = matches!(
            self.config.speculative.as_ref().map(|spec| &spec.method),
            Some(SpeculativeMethod::External)
        );
        if external && draft_token_ids.is_none() && !self.last_drafts.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "the last schedule reserved {} slots for the caller's proposals (the draft \
                 method): pass them as draft_token_ids",
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
            let children = if num_rows > 1 { self.fork(id, num_rows - 1)? } else { Vec::new() };
            updates.push(self.append_token(id, sampled_token_ids[first_row], first_row)?);
            for (offset, child) in children.into_iter().enumerate() {
                let row = first_row + 1 + offset;
                updates.push(self.append_token(child, sampled_token_ids[row], row)?);
            }
            num_appended += num_rows;
        }
        self.stats.num_generated_tokens_total += num_appended as u64;
        // Keep the allocations for the next step.
        owners.clear();
        self.last_logits_owners = owners;
        Ok(updates)
    }

    /// Appends a speculating sequence's verified tokens: the rows that sampled their own
    /// proposal, then the first row that did not (or the bonus row), stopping early when a
    /// stop condition ends it. Returns the number of tokens appended.
    fn append_verified(
        &mut self,
        id: SequenceId,
        rows: &[u32],
        drafts: &[u32],
        first_row: usize,
        updates: &mut Vec<SequenceUpdate>,
    ) -> Result<usize> {
        let num_accepted = rows.iter().zip(drafts).take_while(|(row, draft)| row == draft).count();
        self.stats.num_drafts_total += 1;
        self.stats.num_draft_tokens_total += drafts.len() as u64;
        self.stats.num_accepted_tokens_total += num_accepted as u64;
        for position in 0..num_accepted {
            self.stats.num_accepted_tokens_per_pos[position] += 1;
        }
        // NOTE: verifying a proposal costs compute whether or not it is accepted, so a
        // sequence proposes about as far as it was right last time: one token more than it got
        // accepted, or at least two more when all was (up to `k`). One whose proposals keep failing
        // also backs off exponentially (1, 3, 7, ... decode steps without proposing, at most
        // `MAX_SPEC_COOLDOWN`): on text that does not repeat, verification costs more than it
        // saves.
        let k = self.config.speculative.as_ref().map_or(0, |spec| spec.num_speculative_tokens);
        let seq = self.sequences.get_mut(id).expect("live");
        // A proposal shorter than asked (its index knew no more) that was all accepted does
        // not shrink the next one.
        seq.spec_len = if num_accepted == drafts.len() {
            seq.spec_len.max(num_accepted + 2).min(k)
        } else {
            num_accepted + 1
        };
        if num_accepted == 0 {
            seq.num_spec_misses += 1;
            seq.spec_cooldown = ((1u32 << seq.num_spec_misses.min(16)) - 1).min(MAX_SPEC_COOLDOWN);
        } else {
            seq.num_spec_misses = 0;
        }
        for (offset, &token) in rows[..=num_accepted].iter().enumerate() {
            let update = self.append_token(id, token, first_row + offset)?;
            updates.push(update);
            if update.finish_reason.is_some() {
                return Ok(offset + 1);
            }
        }
        // The accepted proposals' KV was computed from the very tokens now appended.
        self.kv.accept_drafts(id, num_accepted)?;
        self.sequences.get_mut(id).expect("live").num_computed_tokens += num_accepted;
        Ok(num_accepted + 1)
    }

    /// Writes into `drafts` what running sequence `id` proposes after its last token: at most
    /// `room` tokens, `k`, what its `max_tokens` and `max_model_len` leave after the token it
    /// decodes anyway, and nothing unless it decodes an output token and speculates.
    fn propose(&mut self, id: SequenceId, room: usize, drafts: &mut Vec<u32>) -> Result<()> {
        drafts.clear();
        let Some(spec) = &self.config.speculative else {
            return Ok(());
        };
        let seq = self.sequences.get_mut(id).expect("running");
        if seq.num_tokens <= seq.num_prompt_tokens || seq.num_pending_forks > 0 {
            return Ok(());
        }
        if seq.spec_cooldown > 0 {
            seq.spec_cooldown -= 1;
            return Ok(());
        }
        let max_tokens = room
            .min(seq.spec_len)
            .min(seq.stop.max_tokens.saturating_sub(seq.num_output_tokens() + 1))
            .min(self.config.max_model_len.saturating_sub(seq.num_tokens + 1));
        let Some(drafter) = &mut seq.drafter else {
            return Ok(());
        };
        let token_ids = self.kv.token_ids(id)?;
        let shared = self.suffix_cache.as_ref().map(|cache| &cache.trie);
        drafter.propose(&spec.method, token_ids, max_tokens, shared, drafts);
        Ok(())
    }

    /// Whether a running sequence lacks exactly one token (a decode, or the last token of
    /// a prefill: either way one token that will be sampled from).
    fn is_decode(&self, id: &SequenceId) -> bool {
        let seq = &self.sequences[*id];
        seq.num_tokens - seq.num_computed_tokens == 1
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
    /// Proposals (`num_drafts`) get slots only if they fit without a preemption; otherwise
    /// `num_drafts` drops to 0.
    fn allocate_or_preempt(
        &mut self,
        id: SequenceId,
        num_new: usize,
        num_drafts: &mut usize,
        num_decodes_behind: &mut usize,
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
            let num_seats = 1 + self.sequences[id].num_pending_forks;
            let seats_in_use = self.running.len() + admission.num_fork_seats;
            if seats_in_use + num_seats > self.config.max_num_seqs || admission.budget == 0 {
                break;
            }
            let num_cached = self.kv.get_computed_blocks(id)?;
            let remaining = self.sequences[id].num_tokens - num_cached;
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
            let seq = self.sequences.get_mut(id).expect("waiting");
            seq.status = SequenceStatus::Running;
            seq.num_computed_tokens = num_cached + num_new;
            // NOTE: set once, as vLLM reports it: a preempted sequence that finds its
            // prefix again when it is readmitted does not change it.
            let request = self.requests.get_mut(&seq.request).expect("live request");
            request.num_cached_tokens.get_or_insert(num_cached);
            scheduled.push(ScheduledSeq {
                id,
                request: seq.request,
                choice_index: seq.choice_index,
                start: num_cached,
                num_tokens: num_new,
                num_drafts: 0,
                num_samples: if is_partial { 0 } else { num_seats },
                is_decode: false,
            });
            let position = self.running.partition_point(|other| self.sequences[*other].key < key);
            self.running.insert(position, id);
        }
        Ok(())
    }

    /// Frees a running sequence's blocks and requeues it, tokens kept, to recompute.
    fn preempt(&mut self, id: SequenceId) -> Result<()> {
        self.kv.reset(id)?;
        let seq = self.sequences.get_mut(id).expect("running");
        seq.status = SequenceStatus::Preempted;
        seq.num_computed_tokens = 0;
        seq.num_preemptions += 1;
        let key = seq.key;
        self.running.retain(|&other| other != id);
        self.waiting.insert(key, id);
        self.stats.num_preemptions_total += 1;
        Ok(())
    }

    /// Forks `num_forks` children off a sequence whose prompt was just computed; they share
    /// its blocks and sort right after it.
    fn fork(&mut self, parent: SequenceId, num_forks: usize) -> Result<Vec<SequenceId>> {
        let mut children = Vec::with_capacity(num_forks);
        for _ in 0..num_forks {
            let child = self.kv.fork(parent)?;
            let arrival_order = self.take_arrival_order();
            let mut seq = self.sequences[parent].clone();
            let request = self.requests.get_mut(&seq.request).expect("live request");
            seq.id = child;
            seq.choice_index = request.choices.len();
            seq.num_pending_forks = 0;
            seq.key.arrival_order = arrival_order;
            request.choices.push(child);
            let key = seq.key;
            self.sequences.insert(seq);
            let position = self.running.partition_point(|other| self.sequences[*other].key < key);
            self.running.insert(position, child);
            children.push(child);
        }
        self.sequences.get_mut(parent).expect("live").num_pending_forks = 0;
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
            num_cached_tokens: self.requests[&seq.request].reported_num_cached_tokens(),
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
        self.pending_updates.push(SequenceUpdate {
            request: seq.request,
            num_cached_tokens: self.requests[&seq.request].reported_num_cached_tokens(),
            choice_index: seq.choice_index,
            new_token_id: None,
            logits_row: None,
            finish_reason: Some(FinishReason::Capacity),
        });
        self.release(id)
    }

    /// Frees a finished sequence's blocks and forgets it (and its request once no choice
    /// is left).
    fn release(&mut self, id: SequenceId) -> Result<()> {
        if let Some(cache) = &mut self.suffix_cache {
            let seq = &self.sequences[id];
            if seq.drafter.is_some() {
                cache.insert(&self.kv.token_ids(id)?[seq.num_prompt_tokens..]);
            }
        }
        self.kv.free(id)?;
        let seq = self.sequences.remove(id).expect("live");
        match seq.status {
            SequenceStatus::Running => self.running.retain(|&other| other != id),
            SequenceStatus::Waiting | SequenceStatus::Preempted => {
                self.waiting.remove(&seq.key);
            }
        }
        let request = self.requests.get_mut(&seq.request).expect("live request");
        // Forks that will now never happen are finished along with their parent.
        request.num_live -= 1 + seq.num_pending_forks;
        if request.num_live == 0 {
            self.remove_request(seq.request);
        }
        Ok(())
    }

    fn remove_request(&mut self, handle: u64) {
        if let Some(removed) = self.requests.remove(&handle) {
            self.external_id_to_request.remove(&removed.external_id);
        }
    }

    fn handle_of(&self, external_id: &str) -> Result<u64> {
        self.request_handle(external_id)
            .ok_or_else(|| Error::UnknownRequest(external_id.to_owned()))
    }

    fn take_arrival_order(&mut self) -> u64 {
        let arrival_order = self.next_arrival_order;
        self.next_arrival_order += 1;
        arrival_order
    }
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "scheduler_spec_tests.rs"]
mod spec_tests;
