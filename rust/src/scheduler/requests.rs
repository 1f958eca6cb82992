//! The request table: the caller's requests by handle and by id, and the scheduler's
//! request-level calls (add, abort, finish, look up).

use std::collections::HashMap;
use std::sync::Arc;

use super::Scheduler;
use crate::config::{RequestParams, SchedulingPolicy};
use crate::error::{Error, Result};
use crate::kv_cache_manager::SequenceId;
use crate::prefix_cache::BuildPrehashed;
use crate::sequence::{QueueKey, RequestHandle, Sequence, SequenceStatus};

/// A caller's request: one id, `n` sequences once its prompt is computed.
#[derive(Debug, Clone)]
pub(super) struct Request {
    /// The caller's id.
    pub(super) external_id: Arc<str>,
    /// Its sequences by choice index (just the first until the prompt is computed).
    pub(super) choices: Vec<SequenceId>,
    /// Sequences not finished, plus forks still to come.
    pub(super) num_live: usize,
    /// Prompt tokens served from the prefix cache, found when its first sequence was first
    /// scheduled (`None` until then). Preemption and recomputation leave it as it is.
    pub(super) num_cached_tokens: Option<usize>,
    /// Whether the caller wants every prompt position's logits: its sequences take no cached
    /// prefix (see `RequestParams::prompt_logprobs`).
    pub(super) prompt_logprobs: bool,
}

impl Request {
    /// `num_cached_tokens` as reported: 0 for a request never scheduled.
    pub(super) fn reported_num_cached_tokens(&self) -> usize {
        self.num_cached_tokens.unwrap_or(0)
    }
}

/// Live requests, by handle and by the caller's id.
#[derive(Debug, Default)]
pub(super) struct RequestTable {
    /// Live requests by handle.
    handle_to_request: HashMap<RequestHandle, Request, BuildPrehashed>,
    /// Caller ids of live requests to their handle.
    external_id_to_handle: HashMap<Arc<str>, RequestHandle>,
    /// Handle of the next request added.
    next_handle: u64,
}

impl RequestTable {
    /// Registers a request whose first sequence is `first_choice`; returns its new handle.
    /// The caller checked that `external_id` is not live.
    fn insert(
        &mut self,
        external_id: &str,
        first_choice: SequenceId,
        n: usize,
        prompt_logprobs: bool,
    ) -> RequestHandle {
        let handle = RequestHandle(self.next_handle);
        self.next_handle += 1;
        let external_id: Arc<str> = Arc::from(external_id);
        let request = Request {
            external_id: external_id.clone(),
            choices: vec![first_choice],
            num_live: n,
            num_cached_tokens: None,
            prompt_logprobs,
        };
        self.handle_to_request.insert(handle, request);
        self.external_id_to_handle.insert(external_id, handle);
        handle
    }

    /// The handle of the live request with this caller id.
    pub(super) fn handle(&self, external_id: &str) -> Option<RequestHandle> {
        self.external_id_to_handle.get(external_id).copied()
    }

    /// A live request.
    pub(super) fn get(&self, handle: RequestHandle) -> Option<&Request> {
        self.handle_to_request.get(&handle)
    }

    /// A live request, mutably.
    pub(super) fn get_mut(&mut self, handle: RequestHandle) -> Option<&mut Request> {
        self.handle_to_request.get_mut(&handle)
    }

    /// Forgets a request (a no-op for one already gone).
    pub(super) fn remove(&mut self, handle: RequestHandle) {
        if let Some(removed) = self.handle_to_request.remove(&handle) {
            self.external_id_to_handle.remove(&removed.external_id);
        }
    }

    /// Live requests, in no particular order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (RequestHandle, &Request)> {
        self.handle_to_request.iter().map(|(&handle, request)| (handle, request))
    }

    /// Live requests.
    pub(super) fn len(&self) -> usize {
        self.handle_to_request.len()
    }

    /// Caller ids registered (equal to `len` unless the table is inconsistent).
    pub(super) fn num_external_ids(&self) -> usize {
        self.external_id_to_handle.len()
    }
}

impl std::ops::Index<RequestHandle> for RequestTable {
    type Output = Request;

    /// The live request `handle`; the scheduler only indexes handles it knows are live.
    fn index(&self, handle: RequestHandle) -> &Request {
        self.get(handle).expect("a live request handle")
    }
}

impl Scheduler {
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
    ) -> Result<RequestHandle> {
        if self.requests.handle(external_id).is_some() {
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
        let handle = self.requests.insert(external_id, id, params.n, params.prompt_logprobs);
        self.sequences.insert(Sequence {
            id,
            request: handle,
            choice_index: 0,
            num_pending_forks: params.n - 1,
            num_reserved_forks: 0,
            key,
            status: SequenceStatus::Waiting,
            num_prompt_tokens,
            num_tokens: num_prompt_tokens,
            num_computed_tokens: 0,
            stop: params.stop,
            num_preemptions: 0,
        });
        if let Some(spec) = self.spec.as_mut().filter(|_| params.speculate) {
            spec.add(id);
        }
        self.waiting.insert(key, id);
        Ok(handle)
    }

    /// Ends a request and all its choices now, in whatever state, freeing every block.
    pub fn abort_request(&mut self, external_id: &str) -> Result<()> {
        let handle = self.handle_of(external_id)?;
        let choices = self.requests[handle].choices.clone();
        for id in choices {
            if self.sequences.contains(id) {
                self.release(id)?;
            }
        }
        // Forks that never happened die with the request, and so does news of choices
        // `schedule` ended: nothing about an aborted request is reported any more.
        self.requests.remove(handle);
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

    /// Blocks one choice of a live request holds in each KV layer group.
    pub fn held_blocks(&self, external_id: &str, choice_index: usize) -> Result<Vec<usize>> {
        let id = self.live_choice(external_id, choice_index)?;
        self.kv.num_held_blocks(id)
    }

    /// The sequence of one live choice of a live request.
    pub(super) fn live_choice(&self, external_id: &str, choice_index: usize) -> Result<SequenceId> {
        let handle = self.handle_of(external_id)?;
        self.requests[handle]
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
    pub fn request_handle(&self, external_id: &str) -> Option<RequestHandle> {
        self.requests.handle(external_id)
    }

    /// The caller's id of a request handle, while the request is live.
    pub fn external_id(&self, handle: RequestHandle) -> Option<&Arc<str>> {
        self.requests.get(handle).map(|request| &request.external_id)
    }

    /// Prompt tokens of a live request served from the prefix cache when it was first
    /// scheduled (`None` until then).
    pub fn num_cached_tokens(&self, handle: RequestHandle) -> Option<usize> {
        self.requests.get(handle)?.num_cached_tokens
    }

    /// The caller's request and choice index of a live sequence.
    pub fn sequence_of(&self, id: SequenceId) -> Option<(RequestHandle, usize)> {
        self.sequences.get(id).map(|seq| (seq.request, seq.choice_index))
    }

    /// The handle of a live request, or `UnknownRequest`.
    fn handle_of(&self, external_id: &str) -> Result<RequestHandle> {
        self.request_handle(external_id)
            .ok_or_else(|| Error::UnknownRequest(external_id.to_owned()))
    }
}
