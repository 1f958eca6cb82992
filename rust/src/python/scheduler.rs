//! `pagedrs.Scheduler`: the per-step scheduler, with its batch as numpy arrays.

use std::collections::HashMap;

use ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};

use super::{name_request, to_count, to_py_err, to_token_ids};
use crate::batch::SequenceUpdate;
use crate::error::Error;
use crate::metrics::SchedulerStats;
use crate::scheduler::{RequestParams, Scheduler, SchedulerConfig, SchedulingPolicy};
use crate::sequence::{FinishReason, StopConditions};
use crate::speculative::{SpeculativeConfig, SpeculativeMethod};

/// One step's batch. Every array is a fresh numpy array handed over without a copy.
#[pyclass(name = "SchedulerOutput", module = "pagedrs._core", frozen, get_all)]
pub(super) struct PySchedulerOutput {
    /// Request id of each scheduled sequence, in batch order. `list[str]`
    request_ids: Py<PyList>,
    /// Choice index (0..n) of each scheduled sequence. `int32 [num_seqs]`
    choice_indices: Py<PyArray1<i32>>,
    /// Tokens each sequence computes this step. `int32 [num_seqs]`
    num_scheduled_tokens: Py<PyArray1<i32>>,
    /// Token ids of all sequences, concatenated. `int64 [num_batched_tokens]`
    input_token_ids: Py<PyArray1<i64>>,
    /// Position of each input token. `int64 [num_batched_tokens]`
    positions: Py<PyArray1<i64>>,
    /// KV cache slot each new key/value goes to. `int64 [num_batched_tokens]`
    slot_mapping: Py<PyArray1<i64>>,
    /// Start of each sequence's tokens, plus the total. `int32 [num_seqs + 1]`
    query_start_loc: Py<PyArray1<i32>>,
    /// Tokens each sequence attends to, this step's included. `int32 [num_seqs]`
    context_lens: Py<PyArray1<i32>>,
    /// Zero-padded block tables. `int32 [num_seqs, max_blocks]`
    block_tables: Py<PyArray2<i32>>,
    /// Input rows to sample from. `int64 [num_logits]`
    logits_indices: Py<PyArray1<i64>>,
    /// Sequence (row of `request_ids`) each logits row samples for. `int32 [num_logits]`
    logits_request_indices: Py<PyArray1<i32>>,
    /// Choice (0..n) each logits row samples for; a prompt with `n > 1` has rows for
    /// choices 0..n. `int32 [num_logits]`
    logits_choice_indices: Py<PyArray1<i32>>,
    /// Proposed token each logits row verifies, -1 where none. `int64 [num_logits]`
    logits_draft_token_ids: Py<PyArray1<i64>>,
    /// Proposed tokens of each sequence, the last of its scheduled tokens (placeholders 0
    /// under the `draft` method, for the caller to fill). `int32 [num_seqs]`
    num_draft_tokens: Py<PyArray1<i32>>,
    /// Copy-on-write copies `(src, dst)` to do before the forward pass. `int64 [k, 2]`
    block_copies: Py<PyArray2<i64>>,
    /// Sequences in the batch.
    num_seqs: usize,
    /// Tokens in the batch.
    num_batched_tokens: usize,
    /// Prefill tokens in the batch.
    num_prefill_tokens: usize,
    /// Decode tokens in the batch (proposals included).
    num_decode_tokens: usize,
    /// Proposed tokens in the batch.
    num_spec_tokens: usize,
    /// Sequences preempted this step. `list[tuple[str, int]]` of (request id, choice).
    preempted: Py<PyList>,
}

#[pymethods]
impl PySchedulerOutput {
    fn __len__(&self) -> usize {
        self.num_seqs
    }

    fn __repr__(&self) -> String {
        format!(
            "SchedulerOutput(num_seqs={}, num_batched_tokens={}, num_prefill_tokens={}, \
             num_decode_tokens={})",
            self.num_seqs, self.num_batched_tokens, self.num_prefill_tokens, self.num_decode_tokens
        )
    }
}

/// What `update_from_output` did, one row per sequence that got a token or ended, as
/// columns: the engine indexes its sampler's outputs with `logits_rows` instead of building
/// a dict, and reads the rest without a Python object per row (the ids excepted).
#[pyclass(name = "StepUpdates", module = "pagedrs._core", frozen, get_all)]
pub(super) struct PyStepUpdates {
    /// Request id of each row (the string object given to `add_request`). `list[str]`
    request_ids: Py<PyList>,
    /// Choice index (0..n) of each row. `int32 [k]`
    choice_indices: Py<PyArray1<i32>>,
    /// The token appended this step, -1 where none. `int64 [k]`
    token_ids: Py<PyArray1<i64>>,
    /// Row of the sampled tokens (and of the last schedule's `logits_indices`) the token
    /// came from, -1 where none (a sequence `schedule` ended itself). `int32 [k]`
    logits_rows: Py<PyArray1<i32>>,
    /// 0 while running, else 1 + the reason's index in `FINISH_REASONS`. `uint8 [k]`
    finish_codes: Py<PyArray1<u8>>,
    /// Prompt tokens of the row's request served from the prefix cache, found when its
    /// first sequence was first scheduled (the same on every row of the request; 0 for a
    /// request never scheduled). `int64 [k]`
    num_cached_tokens: Py<PyArray1<i64>>,
}

#[pymethods]
impl PyStepUpdates {
    fn __len__(&self, py: Python<'_>) -> usize {
        self.request_ids.bind(py).len()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!("StepUpdates(len={})", self.__len__(py))
    }

    /// The rows as `(request_id, choice_index, token | None, reason | None)` tuples, for
    /// tests and debugging (the engine reads the columns).
    fn to_list<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let choice_indices = self.choice_indices.bind(py).readonly();
        let token_ids = self.token_ids.bind(py).readonly();
        let finish_codes = self.finish_codes.bind(py).readonly();
        let rows = self
            .request_ids
            .bind(py)
            .iter()
            .zip(choice_indices.as_slice()?)
            .zip(token_ids.as_slice()?)
            .zip(finish_codes.as_slice()?)
            .map(|(((request_id, &choice_index), &token), &code)| {
                let reason = finish_reason_name(code).map_err(|err| to_py_err(py, err))?;
                Ok((request_id, choice_index, (token >= 0).then_some(token), reason))
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, rows)
    }
}

/// The name of a `finish_codes` entry: `None` while running.
fn finish_reason_name(code: u8) -> Result<Option<&'static str>, Error> {
    if code == 0 {
        return Ok(None);
    }
    let reason = FinishReason::from_code(code)
        .ok_or_else(|| Error::InvalidArgument(format!("unknown finish code {code}")))?;
    Ok(Some(reason.as_str()))
}

/// A snapshot of the scheduler's counters.
#[pyclass(name = "SchedulerStats", module = "pagedrs._core", frozen, get_all)]
pub(super) struct PySchedulerStats {
    /// Sequences running.
    num_running: usize,
    /// Sequences waiting (preempted included).
    num_waiting: usize,
    /// Of the waiting, those preempted.
    num_preempted_waiting: usize,
    /// Preemptions since start.
    num_preemptions_total: u64,
    /// Prompt tokens looked up in the prefix cache.
    prefix_cache_queries: u64,
    /// Of those, found cached.
    prefix_cache_hits: u64,
    /// KV blocks referenced by a sequence.
    num_used_blocks: usize,
    /// Free KV blocks holding a cached prefix.
    num_cached_free_blocks: usize,
    /// All KV blocks.
    num_blocks: usize,
    /// Cached blocks evicted since start.
    num_evictions: u64,
    /// Used blocks over all blocks.
    kv_cache_usage: f64,
    /// Prefill tokens of the last step.
    step_num_prefill_tokens: usize,
    /// Decode tokens of the last step.
    step_num_decode_tokens: usize,
    /// Prompt tokens computed since start.
    num_prefill_tokens_total: u64,
    /// Tokens sampled since start.
    num_generated_tokens_total: u64,
    /// Sequences' speculative steps since start.
    num_drafts_total: u64,
    /// Proposed tokens since start.
    num_draft_tokens_total: u64,
    /// Proposed tokens accepted since start.
    num_accepted_tokens_total: u64,
    /// Accepted proposals by position in the proposal (0 = first; 32 entries, the most
    /// proposals a step allows).
    num_accepted_tokens_per_pos: Vec<u64>,
}

impl From<SchedulerStats> for PySchedulerStats {
    fn from(s: SchedulerStats) -> Self {
        PySchedulerStats {
            num_running: s.num_running,
            num_waiting: s.num_waiting,
            num_preempted_waiting: s.num_preempted_waiting,
            num_preemptions_total: s.num_preemptions_total,
            prefix_cache_queries: s.prefix_cache_queries,
            prefix_cache_hits: s.prefix_cache_hits,
            num_used_blocks: s.num_used_blocks,
            num_cached_free_blocks: s.num_cached_free_blocks,
            num_blocks: s.num_blocks,
            num_evictions: s.num_evictions,
            kv_cache_usage: s.kv_cache_usage(),
            step_num_prefill_tokens: s.step_num_prefill_tokens,
            step_num_decode_tokens: s.step_num_decode_tokens,
            num_prefill_tokens_total: s.num_prefill_tokens_total,
            num_generated_tokens_total: s.num_generated_tokens_total,
            num_drafts_total: s.num_drafts_total,
            num_draft_tokens_total: s.num_draft_tokens_total,
            num_accepted_tokens_total: s.num_accepted_tokens_total,
            num_accepted_tokens_per_pos: s.num_accepted_tokens_per_pos.to_vec(),
        }
    }
}

/// Python face of `Scheduler`.
#[pyclass(name = "Scheduler", module = "pagedrs._core")]
pub(super) struct PyScheduler {
    /// The core.
    inner: Scheduler,
    /// Each live request's id (by the core's request handle) as a Python string, so
    /// outputs reuse one object.
    handle_to_py_id: HashMap<u64, Py<PyString>>,
    /// Handles of requests the caller finished (`finish_request`) since the last
    /// `update_from_output`, whose ids are forgotten there.
    finished_handles: Vec<u64>,
}

impl PyScheduler {
    fn py_id(&self, py: Python<'_>, handle: u64) -> Py<PyString> {
        match self.handle_to_py_id.get(&handle) {
            Some(id) => id.clone_ref(py),
            None => PyString::new(py, "").unbind(),
        }
    }

    /// The updates as columns.
    fn step_updates(&self, py: Python<'_>, updates: &[SequenceUpdate]) -> PyResult<PyStepUpdates> {
        let num_rows = updates.len();
        let mut choice_indices = Vec::with_capacity(num_rows);
        let mut token_ids = Vec::with_capacity(num_rows);
        let mut logits_rows = Vec::with_capacity(num_rows);
        let mut finish_codes = Vec::with_capacity(num_rows);
        let mut num_cached_tokens = Vec::with_capacity(num_rows);
        for update in updates {
            choice_indices.push(update.choice_index as i32);
            token_ids.push(update.new_token_id.map_or(-1, i64::from));
            logits_rows.push(update.logits_row.map_or(-1, |row| row as i32));
            finish_codes.push(update.finish_reason.map_or(0, FinishReason::code));
            num_cached_tokens.push(update.num_cached_tokens as i64);
        }
        let request_ids = updates.iter().map(|update| self.py_id(py, update.request));
        Ok(PyStepUpdates {
            request_ids: PyList::new(py, request_ids)?.unbind(),
            choice_indices: choice_indices.into_pyarray(py).unbind(),
            token_ids: token_ids.into_pyarray(py).unbind(),
            logits_rows: logits_rows.into_pyarray(py).unbind(),
            finish_codes: finish_codes.into_pyarray(py).unbind(),
            num_cached_tokens: num_cached_tokens.into_pyarray(py).unbind(),
        })
    }

    /// Forgets the Python ids of requests that ended, once nothing left to report names
    /// them: those that ended with these updates, and those the caller finished since the
    /// last `update_from_output` (a capacity update of another choice may still have been
    /// pending then).
    fn forget_finished(&mut self, updates: &[SequenceUpdate]) {
        let finished = updates.iter().filter(|update| update.finish_reason.is_some());
        let ended = finished.map(|update| update.request).chain(self.finished_handles.drain(..));
        for handle in ended {
            if self.inner.external_id(handle).is_none() {
                self.handle_to_py_id.remove(&handle);
            }
        }
    }
}

/// Sampled token ids from a numpy array (int64 or int32) or any sequence of ints.
fn sampled_tokens(sampled: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if let Ok(array) = sampled.extract::<PyReadonlyArray1<'_, i64>>() {
        return Ok(array.as_slice()?.to_vec());
    }
    if let Ok(array) = sampled.extract::<PyReadonlyArray1<'_, i32>>() {
        return Ok(array.as_slice()?.iter().map(|&t| i64::from(t)).collect());
    }
    sampled.extract::<Vec<i64>>()
}

fn parse_policy(policy: &str) -> Result<SchedulingPolicy, Error> {
    match policy {
        "fcfs" => Ok(SchedulingPolicy::Fcfs),
        "priority" => Ok(SchedulingPolicy::Priority),
        other => Err(Error::InvalidArgument(format!(
            "policy must be \"fcfs\" or \"priority\", got {other:?}"
        ))),
    }
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (
        num_blocks,
        block_size = 16,
        *,
        max_num_batched_tokens = 2048,
        max_num_seqs = 256,
        max_model_len = 8192,
        policy = "fcfs",
        enable_prefix_caching = true,
        long_prefill_token_threshold = None,
        max_num_partial_prefills = 1,
        namespace = "",
        speculative_method = None,
        num_speculative_tokens = 0,
        prompt_lookup_min = 1,
        prompt_lookup_max = 4,
        suffix_max_tree_depth = 24,
        suffix_min_token_prob = 0.1,
        suffix_max_spec_factor = 1.0,
        suffix_max_cached_requests = 10000,
        spec_disable_by_batch_size = None,
    ))]
    // One parameter per Python keyword argument: the signature is the Python API.
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: i64,
        block_size: i64,
        max_num_batched_tokens: i64,
        max_num_seqs: i64,
        max_model_len: i64,
        policy: &str,
        enable_prefix_caching: bool,
        long_prefill_token_threshold: Option<i64>,
        max_num_partial_prefills: i64,
        namespace: &str,
        speculative_method: Option<&str>,
        num_speculative_tokens: i64,
        prompt_lookup_min: i64,
        prompt_lookup_max: i64,
        suffix_max_tree_depth: i64,
        suffix_min_token_prob: f64,
        suffix_max_spec_factor: f64,
        suffix_max_cached_requests: i64,
        spec_disable_by_batch_size: Option<i64>,
    ) -> PyResult<Self> {
        let build = || -> Result<Scheduler, Error> {
            let method = match speculative_method {
                None => None,
                Some("ngram") => Some(SpeculativeMethod::Ngram {
                    min_n: to_count(prompt_lookup_min, "prompt_lookup_min")?,
                    max_n: to_count(prompt_lookup_max, "prompt_lookup_max")?,
                }),
                Some("suffix") => Some(SpeculativeMethod::Suffix {
                    max_depth: to_count(suffix_max_tree_depth, "suffix_max_tree_depth")?,
                    min_token_prob: suffix_min_token_prob,
                    max_spec_factor: suffix_max_spec_factor,
                    max_cached_requests: to_count(
                        suffix_max_cached_requests,
                        "suffix_max_cached_requests",
                    )?,
                }),
                Some("draft") => Some(SpeculativeMethod::External),
                Some(other) => {
                    return Err(Error::InvalidArgument(format!(
                        "speculative_method must be \"ngram\", \"suffix\" or \"draft\", got \
                         {other:?}"
                    )))
                }
            };
            let speculative = match method {
                None => None,
                Some(method) => Some(SpeculativeConfig {
                    method,
                    num_speculative_tokens: to_count(
                        num_speculative_tokens,
                        "num_speculative_tokens",
                    )?,
                    disable_by_batch_size: spec_disable_by_batch_size
                        .map(|size| to_count(size, "disable_by_batch_size"))
                        .transpose()?,
                }),
            };
            Scheduler::new(SchedulerConfig {
                num_blocks: to_count(num_blocks, "num_blocks")?,
                block_size: to_count(block_size, "block_size")?,
                enable_prefix_caching,
                namespace: namespace.to_owned(),
                max_num_batched_tokens: to_count(max_num_batched_tokens, "max_num_batched_tokens")?,
                max_num_seqs: to_count(max_num_seqs, "max_num_seqs")?,
                max_model_len: to_count(max_model_len, "max_model_len")?,
                policy: parse_policy(policy)?,
                long_prefill_token_threshold: long_prefill_token_threshold
                    .map(|t| to_count(t, "long_prefill_token_threshold"))
                    .transpose()?,
                max_num_partial_prefills: to_count(
                    max_num_partial_prefills,
                    "max_num_partial_prefills",
                )?,
                speculative,
            })
        };
        let inner = build().map_err(|err| to_py_err(py, err))?;
        Ok(PyScheduler { inner, handle_to_py_id: HashMap::new(), finished_handles: Vec::new() })
    }

    /// Queues a request.
    #[pyo3(signature = (
        request_id,
        prompt_token_ids,
        *,
        max_tokens = 16,
        min_tokens = 0,
        eos_token_id = None,
        stop_token_ids = None,
        ignore_eos = false,
        n = 1,
        priority = 0,
        cache_salt = None,
        arrival_time = None,
        speculate = true,
    ))]
    // One parameter per Python keyword argument: the signature is the Python API.
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        py: Python<'_>,
        request_id: &Bound<'_, PyString>,
        prompt_token_ids: Vec<i64>,
        max_tokens: i64,
        min_tokens: i64,
        eos_token_id: Option<i64>,
        stop_token_ids: Option<Vec<i64>>,
        ignore_eos: bool,
        n: i64,
        priority: i64,
        cache_salt: Option<String>,
        arrival_time: Option<f64>,
        speculate: bool,
    ) -> PyResult<()> {
        let external_id = request_id.to_str()?;
        let result = (|| {
            let prompt = to_token_ids(prompt_token_ids)?;
            let eos_token_id = match eos_token_id {
                Some(token) => to_token_ids(vec![token])?.first().copied(),
                None => None,
            };
            let params = RequestParams {
                stop: StopConditions {
                    max_tokens: to_count(max_tokens, "max_tokens")?,
                    min_tokens: to_count(min_tokens, "min_tokens")?,
                    eos_token_id,
                    stop_token_ids: to_token_ids(stop_token_ids.unwrap_or_default())?,
                    ignore_eos,
                },
                n: to_count(n, "n")?,
                priority,
                cache_salt,
                arrival_time,
                speculate,
            };
            self.inner.add_request(external_id, &prompt, params)
        })();
        let handle = result.map_err(|err| to_py_err(py, name_request(err, external_id)))?;
        self.handle_to_py_id.insert(handle, request_id.clone().unbind());
        Ok(())
    }

    /// Ends a request (all its choices) now, freeing its blocks.
    fn abort_request(&mut self, py: Python<'_>, request_id: &str) -> PyResult<()> {
        let handle = self.inner.request_handle(request_id);
        self.inner.abort_request(request_id).map_err(|err| to_py_err(py, err))?;
        if let Some(handle) = handle {
            self.handle_to_py_id.remove(&handle);
        }
        Ok(())
    }

    /// Ends one choice of a request for a reason the caller decided (e.g. a stop string
    /// matched), freeing its blocks. `reason` is validated but not reported back: the next
    /// `update_from_output` says nothing of this choice.
    #[pyo3(signature = (request_id, reason = "stop", index = 0))]
    fn finish_request(
        &mut self,
        py: Python<'_>,
        request_id: &str,
        reason: &str,
        index: i64,
    ) -> PyResult<()> {
        let handle = self.inner.request_handle(request_id);
        let result = (|| {
            if FinishReason::parse(reason).is_none() {
                return Err(Error::InvalidArgument(format!(
                    "reason must be one of stop, length, abort, capacity; got {reason:?}"
                )));
            }
            self.inner.finish_request(request_id, to_count(index, "index")?)
        })();
        result.map_err(|err| to_py_err(py, err))?;
        self.finished_handles.extend(handle);
        Ok(())
    }

    /// Decides this step's batch.
    fn schedule(&mut self, py: Python<'_>) -> PyResult<PySchedulerOutput> {
        let out = self.inner.schedule().map_err(|err| to_py_err(py, err))?;
        let ids = out.requests.iter().map(|&handle| self.py_id(py, handle));
        let request_ids = PyList::new(py, ids)?.unbind();
        let preempted = out
            .preempted
            .iter()
            .filter_map(|&id| self.inner.sequence_of(id))
            .map(|(handle, choice_index)| (self.py_id(py, handle), choice_index));
        let preempted = PyList::new(py, preempted)?.unbind();
        let width = out.block_table_width;
        let rows = out.sequence_ids.len();
        let block_tables = Array2::from_shape_vec((rows, width), out.block_tables)
            .map_err(|err| to_py_err(py, Error::InvariantViolation(err.to_string())))?;
        let copies: Vec<i64> = out
            .block_copies
            .iter()
            .flat_map(|c| [i64::from(c.src.0), i64::from(c.dst.0)])
            .collect();
        let block_copies = Array2::from_shape_vec((out.block_copies.len(), 2), copies)
            .map_err(|err| to_py_err(py, Error::InvariantViolation(err.to_string())))?;
        let choice_indices: Vec<i32> = out.choice_indices.iter().map(|&c| c as i32).collect();
        Ok(PySchedulerOutput {
            num_seqs: rows,
            num_batched_tokens: out.input_token_ids.len(),
            request_ids,
            choice_indices: choice_indices.into_pyarray(py).unbind(),
            num_scheduled_tokens: out.num_scheduled_tokens.into_pyarray(py).unbind(),
            input_token_ids: out.input_token_ids.into_pyarray(py).unbind(),
            positions: out.positions.into_pyarray(py).unbind(),
            slot_mapping: out.slot_mapping.into_pyarray(py).unbind(),
            query_start_loc: out.query_start_loc.into_pyarray(py).unbind(),
            context_lens: out.context_lens.into_pyarray(py).unbind(),
            block_tables: block_tables.into_pyarray(py).unbind(),
            logits_indices: out.logits_indices.into_pyarray(py).unbind(),
            logits_request_indices: out.logits_request_indices.into_pyarray(py).unbind(),
            logits_choice_indices: out.logits_choice_indices.into_pyarray(py).unbind(),
            logits_draft_token_ids: out.logits_draft_token_ids.into_pyarray(py).unbind(),
            num_draft_tokens: out.num_draft_tokens.into_pyarray(py).unbind(),
            block_copies: block_copies.into_pyarray(py).unbind(),
            num_prefill_tokens: out.num_prefill_tokens,
            num_decode_tokens: out.num_decode_tokens,
            num_spec_tokens: out.num_spec_tokens,
            preempted,
        })
    }

    /// Appends the sampled tokens (one per `logits_indices` row of the last `schedule`) and
    /// returns, as columns, one row per appended token (a speculating sequence may get
    /// several, in order) or per sequence that `schedule` ended. `draft_token_ids`: the
    /// proposals the caller wrote into the batch under the `draft` method, in row order.
    #[pyo3(signature = (sampled_token_ids, draft_token_ids = None))]
    fn update_from_output(
        &mut self,
        py: Python<'_>,
        sampled_token_ids: &Bound<'_, PyAny>,
        draft_token_ids: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyStepUpdates> {
        let sampled = sampled_tokens(sampled_token_ids)?;
        let sampled = to_token_ids(sampled).map_err(|err| to_py_err(py, err))?;
        let drafts = match draft_token_ids {
            Some(drafts) => {
                Some(to_token_ids(sampled_tokens(drafts)?).map_err(|err| to_py_err(py, err))?)
            }
            None => None,
        };
        let updates = self
            .inner
            .update_from_output_with_drafts(&sampled, drafts.as_deref())
            .map_err(|err| to_py_err(py, err))?;
        let step_updates = self.step_updates(py, &updates)?;
        self.forget_finished(&updates);
        Ok(step_updates)
    }

    /// `"waiting"`, `"running"` or `"preempted"` for one choice of a live request.
    #[pyo3(signature = (request_id, index = 0))]
    fn request_status(
        &self,
        py: Python<'_>,
        request_id: &str,
        index: i64,
    ) -> PyResult<&'static str> {
        let result = (|| self.inner.status(request_id, to_count(index, "index")?))();
        result.map(|status| status.as_str()).map_err(|err| to_py_err(py, err))
    }

    /// Whether any request is waiting or running.
    fn has_unfinished_requests(&self) -> bool {
        self.inner.has_unfinished_requests()
    }

    #[getter]
    fn num_running(&self) -> usize {
        self.inner.num_running()
    }

    #[getter]
    fn num_waiting(&self) -> usize {
        self.inner.num_waiting()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.config().block_size
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.config().num_blocks
    }

    #[getter]
    fn max_model_len(&self) -> usize {
        self.inner.config().max_model_len
    }

    fn stats(&self) -> PySchedulerStats {
        self.inner.stats().into()
    }

    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.inner
            .kv_cache()
            .pool()
            .check_invariants()
            .map_err(|violation| to_py_err(py, Error::InvariantViolation(violation)))
    }
}
