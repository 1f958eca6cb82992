//! How the scheduler speculates: which sequences propose, how many tokens, and what each
//! verification teaches it. The proposers themselves are in `crate::speculative`.
//!
//! The policy, per speculating sequence (`SpecState`): propose about as far as the last
//! proposal was right, and back off exponentially while proposals keep failing.

use super::Scheduler;
use crate::batch::SequenceUpdate;
use crate::error::Result;
use crate::kv_cache_manager::SequenceId;
use crate::speculative::{Drafter, SpeculativeConfig, SpeculativeMethod, SuffixCache};

/// Most decode steps a sequence sits out after proposals that all failed (see
/// `SpecState::record_verification`).
const MAX_SPEC_COOLDOWN: u32 = 15;

/// A speculating sequence's proposer and how far it proposes next.
#[derive(Debug, Clone)]
struct SequenceSpec {
    /// The sequence (its slot index keys `SpecState::sequences`).
    id: SequenceId,
    /// Its proposer.
    drafter: Drafter,
    /// Speculative steps in a row in which none of its proposals was accepted.
    num_misses: u32,
    /// Decode steps it still sits out before proposing again (after misses).
    cooldown: u32,
    /// Most tokens it proposes next step: one more than it got accepted last time, growing
    /// back towards `k` while whole proposals are accepted.
    next_len: usize,
}

/// The scheduler's speculation state: the settings, each speculating sequence's proposer
/// and policy state, and the outputs suffix decoding shares between sequences.
#[derive(Debug)]
pub(super) struct SpecState {
    /// The settings (`SchedulerConfig::speculative`).
    config: SpeculativeConfig,
    /// Each speculating sequence's state, by `SequenceId::index()`; `None` for a sequence
    /// that does not speculate or a free slot.
    sequences: Vec<Option<SequenceSpec>>,
    /// Outputs of recently finished sequences (suffix decoding only).
    suffix_cache: Option<SuffixCache>,
}

impl SpecState {
    /// No sequence speculating yet.
    pub(super) fn new(config: &SpeculativeConfig) -> Self {
        let suffix_cache = match config.method {
            SpeculativeMethod::Suffix { max_depth, max_cached_requests, .. } => {
                Some(SuffixCache::new(max_depth, max_cached_requests))
            }
            _ => None,
        };
        SpecState { config: config.clone(), sequences: Vec::new(), suffix_cache }
    }

    /// Whether the caller writes the proposals (a draft model) rather than the core.
    pub(super) fn caller_proposes(&self) -> bool {
        self.config.method == SpeculativeMethod::DraftModel
    }

    /// Whether sequences may propose in a step that starts with `num_running` running.
    pub(super) fn allows_step(&self, num_running: usize) -> bool {
        self.config.disable_by_batch_size.is_none_or(|limit| num_running < limit)
    }

    /// Starts speculating for a new sequence.
    pub(super) fn add(&mut self, id: SequenceId) {
        self.insert(SequenceSpec {
            id,
            drafter: Drafter::new(&self.config.method),
            num_misses: 0,
            cooldown: 0,
            next_len: self.config.num_speculative_tokens,
        });
    }

    /// A forked child speculates as its parent does, from the parent's state.
    pub(super) fn fork(&mut self, parent: SequenceId, child: SequenceId) {
        if let Some(spec) = self.get_mut(parent).cloned() {
            self.insert(SequenceSpec { id: child, ..spec });
        }
    }

    /// Forgets a sequence that ended; a speculating one's output joins the suffix cache.
    pub(super) fn release(&mut self, id: SequenceId, output_token_ids: &[u32]) {
        if self.get_mut(id).is_none() {
            return;
        }
        self.sequences[id.index()] = None;
        if let Some(cache) = &mut self.suffix_cache {
            cache.insert(output_token_ids);
        }
    }

    /// Writes into `out` what sequence `id`, whose known tokens are `token_ids`, proposes:
    /// at most `max_tokens` and its `next_len`; nothing while it sits out a cooldown step (which
    /// this counts down) or when it does not speculate.
    pub(super) fn propose(
        &mut self,
        id: SequenceId,
        token_ids: &[u32],
        max_tokens: usize,
        out: &mut Vec<u32>,
    ) {
        out.clear();
        let Some(spec) = self.sequences.get_mut(id.index()).and_then(Option::as_mut) else {
            return;
        };
        if spec.id != id {
            return;
        }
        if spec.cooldown > 0 {
            spec.cooldown -= 1;
            return;
        }
        let shared = self.suffix_cache.as_ref().map(|cache| &cache.trie);
        let max_tokens = max_tokens.min(spec.next_len);
        spec.drafter.propose(&self.config.method, token_ids, max_tokens, shared, out);
    }

    /// Learns from a verification of `num_proposed` proposals of which the first
    /// `num_accepted` were accepted.
    fn record_verification(&mut self, id: SequenceId, num_proposed: usize, num_accepted: usize) {
        let k = self.config.num_speculative_tokens;
        let Some(spec) = self.get_mut(id) else {
            return;
        };
        // NOTE: verifying a proposal costs compute whether or not it is accepted, so a
        // sequence proposes about as far as it was right last time: one token more than it
        // got accepted, or at least two more when all was (up to `k`); a proposal shorter
        // than asked (its index knew no more) that was all accepted does not shrink the
        // next one. One whose proposals keep failing also backs off exponentially (1, 3, 7,
        // ... decode steps without proposing, at most `MAX_SPEC_COOLDOWN`): on text that
        // does not repeat, verification costs more than it saves.
        spec.next_len = if num_accepted == num_proposed {
            spec.next_len.max(num_accepted + 2).min(k)
        } else {
            num_accepted + 1
        };
        if num_accepted == 0 {
            spec.num_misses += 1;
            spec.cooldown = ((1u32 << spec.num_misses.min(16)) - 1).min(MAX_SPEC_COOLDOWN);
        } else {
            spec.num_misses = 0;
        }
    }

    /// Stores a sequence's state under its slot.
    fn insert(&mut self, spec: SequenceSpec) {
        let index = spec.id.index();
        if self.sequences.len() <= index {
            self.sequences.resize_with(index + 1, || None);
        }
        self.sequences[index] = Some(spec);
    }

    /// The state of a speculating sequence.
    fn get_mut(&mut self, id: SequenceId) -> Option<&mut SequenceSpec> {
        self.sequences.get_mut(id.index())?.as_mut().filter(|spec| spec.id == id)
    }
}

impl Scheduler {
    /// Writes into `drafts` what running sequence `id` proposes after its last token: at most
    /// `room` tokens, and what its `max_tokens` and `max_model_len` leave after the token it
    /// decodes anyway; nothing unless it decodes an output token and speculates.
    pub(super) fn propose(
        &mut self,
        id: SequenceId,
        room: usize,
        drafts: &mut Vec<u32>,
    ) -> Result<()> {
        drafts.clear();
        let Some(spec) = &mut self.spec else {
            return Ok(());
        };
        let seq = &self.sequences[id];
        if seq.num_tokens <= seq.num_prompt_tokens || seq.num_pending_forks > 0 {
            return Ok(());
        }
        let max_tokens = room
            .min(seq.stop.max_tokens.saturating_sub(seq.num_output_tokens() + 1))
            .min(self.config.max_model_len.saturating_sub(seq.num_tokens + 1));
        spec.propose(id, self.kv.token_ids(id)?, max_tokens, drafts);
        Ok(())
    }

    /// Appends a speculating sequence's verified tokens: the rows that sampled their own
    /// proposal, then the first row that did not (or the bonus row), stopping early when a
    /// stop condition ends it. Returns the number of tokens appended.
    pub(super) fn append_verified(
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
        if let Some(spec) = &mut self.spec {
            spec.record_verification(id, drafts.len(), num_accepted);
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
}
