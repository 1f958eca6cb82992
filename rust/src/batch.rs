//! `SchedulerOutput`: one step's batch as flat arrays the runner hands to torch without a
//! Python loop.
//!
//! For a step with sequences A (a 3-token prefill chunk starting at position 0) and B (one
//! decode token at position 9), block size 4:
//!
//! ```text
//!   input_token_ids   [a0 a1 a2 | b9]          positions   [0 1 2 | 9]
//!   query_start_loc   [0, 3, 4]                context_lens [3, 10]
//!   slot_mapping      [A0*4+0, A0*4+1, A0*4+2 | B2*4+1]   (Ak = k-th block of A)
//!   block_tables      [[A0, 0, 0], [B0, B1, B2]]  (padded with 0 past each row's blocks)
//!   logits_indices    [2, 3]   rows whose hidden state is sampled (a sequence that caught
//!                              up with its tokens; a prompt with n > 1 appears n times)
//!   logits_request_indices [0, 1]     logits_choice_indices [0, 0]
//! ```
//!
//! Had A asked for n = 2, its last prompt row would be sampled twice, once per choice (the
//! choice 1 sequence is forked off A when `update_from_output` gets its token):
//!
//! ```text
//!   logits_indices    [2, 2, 3]    logits_request_indices [0, 0, 1]
//!   logits_choice_indices [0, 1, 0]
//! ```
//!
//! A speculative decode of B proposing `d1 d2` puts them after its token, and samples each
//! of its rows (see `speculative`): B's inputs become `[b9 d1 d2]` at positions 9..12,
//! `logits_indices` gets B's three rows, and `logits_draft_token_ids` says which proposal
//! each row verifies (`[d1, d2, -1]`: the last row is the bonus).
//!
//! With several KV layer groups (`SchedulerConfig::kv_group_windows`), `slot_mapping` and
//! `block_tables` have one such array per group, stacked: `[num_groups, ...]`. A sliding
//! group's table reads 0 where a block fell out of its window and was released: no query
//! of the step reads there, and nothing is written there.
//!
//! NOTE (the runner's contract): do `block_copies` first; then, in every layer, write all
//! of the batch's new keys/values before any attention of that layer reads the cache. A
//! sequence's prefix hit may point at blocks that another sequence of the same batch is
//! computing in this very step (prefixes are cached when allocated, as in vLLM).

use crate::kv_cache_manager::{BlockCopy, GroupBlocks, SequenceId};
use crate::sequence::{FinishReason, RequestHandle};

/// One token appended to a sequence in `update_from_output` (a speculating sequence may get
/// several, one update each, in order), or a sequence the scheduler had to end on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequenceUpdate {
    /// The caller's request (see `Scheduler::external_id`).
    pub request: RequestHandle,
    /// Prompt tokens of that request served from the prefix cache when it was first
    /// scheduled; 0 if it never was (ended by `schedule` before its first step).
    pub num_cached_tokens: usize,
    /// Which of its `n` choices.
    pub choice_index: usize,
    /// The token appended, if any.
    pub new_token_id: Option<u32>,
    /// The logits row (of the last schedule's `logits_indices`, and of the sampled tokens)
    /// that token came from; `None` when it got no token (ended by `schedule` itself).
    pub logits_row: Option<usize>,
    /// Set when the sequence ended; its blocks are already free.
    pub finish_reason: Option<FinishReason>,
}

/// One step's batch.
#[derive(Debug, Clone, Default)]
pub struct SchedulerOutput {
    /// Scheduled sequences, in batch order.
    pub sequence_ids: Vec<SequenceId>,
    /// The caller's request of each scheduled sequence.
    pub requests: Vec<RequestHandle>,
    /// Choice index of each scheduled sequence.
    pub choice_indices: Vec<u32>,
    /// Tokens each scheduled sequence computes this step.
    pub num_scheduled_tokens: Vec<i32>,
    /// Token ids to embed, all sequences concatenated. `[num_batched_tokens]`
    pub input_token_ids: Vec<i64>,
    /// Position of each input token in its sequence. `[num_batched_tokens]`
    pub positions: Vec<i64>,
    /// Cache slot (`block * block_size + offset`) each new key/value is written to, in
    /// each layer group. Row-major `[num_groups, num_batched_tokens]`.
    pub slot_mapping: Vec<i64>,
    /// Where each sequence's tokens start in the inputs, plus the total. `[num_seqs + 1]`
    pub query_start_loc: Vec<i32>,
    /// Tokens each sequence attends to (computed before this step + this step's).
    /// `[num_seqs]`
    pub context_lens: Vec<i32>,
    /// Prompt length of each sequence's request (what length-dependent rotary embeddings
    /// choose their frequencies by). `[num_seqs]`
    pub prompt_lens: Vec<i32>,
    /// Block tables of each layer group, row-major `[num_groups, num_seqs,
    /// block_table_width]`, zero-padded (and zero where a sliding group released a block).
    pub block_tables: Vec<i32>,
    /// KV layer groups (the leading dimension of `slot_mapping` and `block_tables`).
    pub num_groups: usize,
    /// Tokens and sequences `for_sequences` sized the group arrays for (their strides).
    planned: (usize, usize),
    /// Columns of `block_tables`: the most blocks any scheduled sequence needs.
    pub block_table_width: usize,
    /// Input rows whose logits are sampled. `[num_logits]`
    pub logits_indices: Vec<i64>,
    /// For each logits row, the index of its sequence in `sequence_ids` (named after the
    /// Python column, which indexes `request_ids`, one per scheduled sequence).
    /// `[num_logits]`
    pub logits_request_indices: Vec<i32>,
    /// For each logits row, the choice (0..n) its token goes to: a prompt with `n > 1`
    /// has rows for choices 0..n, in order, though only choice 0 is scheduled.
    /// `[num_logits]`
    pub logits_choice_indices: Vec<i32>,
    /// For each logits row, the proposed token it verifies (-1: none, sample freely).
    /// `[num_logits]`
    pub logits_draft_token_ids: Vec<i64>,
    /// Proposed tokens of each scheduled sequence (they follow its known tokens in the
    /// inputs and are counted in `num_scheduled_tokens`). `[num_seqs]`
    pub num_draft_tokens: Vec<i32>,
    /// Copy-on-write block copies to do before the forward pass.
    pub block_copies: Vec<BlockCopy>,
    /// Tokens of prompts (or recomputed sequences) in this batch.
    pub num_prefill_tokens: usize,
    /// Tokens of sequences decoding one new token (proposed tokens included).
    pub num_decode_tokens: usize,
    /// Proposed tokens in the batch.
    pub num_spec_tokens: usize,
    /// Sequences preempted while building this batch.
    pub preempted: Vec<SequenceId>,
}

impl SchedulerOutput {
    /// Total tokens in the batch.
    pub fn num_batched_tokens(&self) -> usize {
        self.input_token_ids.len()
    }

    /// Whether nothing was scheduled.
    pub fn is_empty(&self) -> bool {
        self.sequence_ids.is_empty()
    }
}

/// One scheduled sequence, before the arrays are built.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ScheduledSeq {
    /// The sequence.
    pub id: SequenceId,
    /// Its caller's request.
    pub request: RequestHandle,
    /// Its choice index.
    pub choice_index: usize,
    /// First position computed this step.
    pub start: usize,
    /// Known tokens computed this step.
    pub num_tokens: usize,
    /// Proposed tokens scheduled after them (their rows are all sampled).
    pub num_drafts: usize,
    /// Logits rows to sample from its last token (0 for an unfinished prefill chunk).
    pub num_samples: usize,
    /// Whether these tokens are a decode (one generated token) rather than a prefill.
    pub is_decode: bool,
    /// Its request's prompt length.
    pub num_prompt_tokens: usize,
}

impl SchedulerOutput {
    /// An empty batch with room for `scheduled`, its slot mapping and block tables (of
    /// `num_groups` layer groups) already sized.
    pub(crate) fn for_sequences(
        scheduled: &[ScheduledSeq],
        block_size: usize,
        num_groups: usize,
    ) -> Self {
        let num_tokens: usize = scheduled.iter().map(|seq| seq.num_tokens + seq.num_drafts).sum();
        let num_logits: usize = scheduled.iter().map(|seq| seq.num_samples + seq.num_drafts).sum();
        let width = scheduled
            .iter()
            .map(|seq| (seq.start + seq.num_tokens + seq.num_drafts).div_ceil(block_size))
            .max()
            .unwrap_or(0);
        let num_seqs = scheduled.len();
        let mut query_start_loc = Vec::with_capacity(num_seqs + 1);
        if num_seqs > 0 {
            query_start_loc.push(0);
        }
        SchedulerOutput {
            sequence_ids: Vec::with_capacity(num_seqs),
            requests: Vec::with_capacity(num_seqs),
            choice_indices: Vec::with_capacity(num_seqs),
            num_scheduled_tokens: Vec::with_capacity(num_seqs),
            input_token_ids: Vec::with_capacity(num_tokens),
            positions: Vec::with_capacity(num_tokens),
            slot_mapping: vec![0; num_groups * num_tokens],
            query_start_loc,
            context_lens: Vec::with_capacity(num_seqs),
            prompt_lens: Vec::with_capacity(num_seqs),
            block_tables: vec![0; num_groups * width * num_seqs],
            block_table_width: width,
            num_groups,
            planned: (num_tokens, num_seqs),
            logits_indices: Vec::with_capacity(num_logits),
            logits_request_indices: Vec::with_capacity(num_logits),
            logits_choice_indices: Vec::with_capacity(num_logits),
            logits_draft_token_ids: Vec::with_capacity(num_logits),
            num_draft_tokens: Vec::with_capacity(num_seqs),
            ..Default::default()
        }
    }

    /// Appends one scheduled sequence whose known tokens are `token_ids`, blocks `groups`
    /// (one table per layer group) and proposals `drafts` (`seq.num_drafts` of them).
    pub(crate) fn push(
        &mut self,
        seq: &ScheduledSeq,
        token_ids: &[u32],
        drafts: &[u32],
        groups: &[GroupBlocks],
        block_size: usize,
    ) {
        debug_assert_eq!(groups.len(), self.num_groups);
        debug_assert_eq!(drafts.len(), seq.num_drafts);
        let row = self.sequence_ids.len();
        let end = seq.start + seq.num_tokens + seq.num_drafts;
        self.sequence_ids.push(seq.id);
        self.requests.push(seq.request);
        self.choice_indices.push(seq.choice_index as u32);
        self.num_scheduled_tokens.push((seq.num_tokens + seq.num_drafts) as i32);
        self.num_draft_tokens.push(seq.num_drafts as i32);
        let first_row = self.input_token_ids.len();
        let known = &token_ids[seq.start..seq.start + seq.num_tokens];
        self.input_token_ids.extend(known.iter().chain(drafts).map(|&t| i64::from(t)));
        self.positions.extend((seq.start..end).map(|p| p as i64));
        let (num_step_tokens, num_seqs) = self.planned;
        let num_blocks = end.div_ceil(block_size);
        let width = self.block_table_width;
        for (group, blocks) in groups.iter().enumerate() {
            let table = blocks.table();
            let slots = &mut self.slot_mapping[group * num_step_tokens..][first_row..];
            for (slot, position) in slots.iter_mut().zip(seq.start..end) {
                let block = table[position / block_size].0 as usize;
                *slot = (block * block_size + position % block_size) as i64;
            }
            // Released blocks (all before the first held one) stay 0.
            let (start, held) =
                ((group * num_seqs + row) * width, blocks.first_held().min(num_blocks));
            let out = &mut self.block_tables[start + held..start + num_blocks];
            for (slot, block) in out.iter_mut().zip(&table[held..num_blocks]) {
                *slot = block.0 as i32;
            }
        }
        self.query_start_loc.push(self.input_token_ids.len() as i32);
        self.context_lens.push(end as i32);
        self.prompt_lens.push(seq.num_prompt_tokens as i32);
        let last_row = (first_row + seq.num_tokens - 1) as i64;
        for (offset, &draft) in drafts.iter().enumerate() {
            self.logits_indices.push(last_row + offset as i64);
            self.logits_request_indices.push(row as i32);
            self.logits_choice_indices.push(seq.choice_index as i32);
            self.logits_draft_token_ids.push(i64::from(draft));
        }
        let bonus_row = last_row + seq.num_drafts as i64;
        for k in 0..seq.num_samples {
            self.logits_indices.push(bonus_row);
            self.logits_request_indices.push(row as i32);
            self.logits_choice_indices.push((seq.choice_index + k) as i32);
            self.logits_draft_token_ids.push(-1);
        }
        self.num_spec_tokens += seq.num_drafts;
        if seq.is_decode {
            self.num_decode_tokens += seq.num_tokens + seq.num_drafts;
        } else {
            self.num_prefill_tokens += seq.num_tokens;
        }
    }
}
