//! The binding's output classes: one step's batch (`SchedulerOutput`), what
//! `update_from_output` did (`StepUpdates`), and the Python faces of the core's stats
//! structs (`SchedulerStats`, `KVCacheStats`, exported as they are with `get_all`).

use ndarray::{Array2, Array3};
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArray3, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};

use super::to_py_err;
use crate::batch::{SchedulerOutput, SequenceUpdate};
use crate::error::Error;
use crate::kv_cache_manager::KVCacheStats;
use crate::metrics::SchedulerStats;
use crate::sequence::FinishReason;

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
    /// KV cache slot each new key/value goes to, in each KV layer group.
    /// `int64 [num_groups, num_batched_tokens]`
    slot_mapping: Py<PyArray2<i64>>,
    /// Start of each sequence's tokens, plus the total. `int32 [num_seqs + 1]`
    query_start_loc: Py<PyArray1<i32>>,
    /// Tokens each sequence attends to, this step's included. `int32 [num_seqs]`
    context_lens: Py<PyArray1<i32>>,
    /// Prompt length of each sequence's request. `int32 [num_seqs]`
    prompt_lens: Py<PyArray1<i32>>,
    /// Zero-padded block tables of each KV layer group (zero, too, where a sliding group
    /// released a block out of its window). `int32 [num_groups, num_seqs, max_blocks]`
    block_tables: Py<PyArray3<i32>>,
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
    /// under the `draft_model` method, for the caller to fill). `int32 [num_seqs]`
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

impl PySchedulerOutput {
    /// The batch as numpy arrays (the core's vectors, handed over without a copy).
    /// `request_ids` and `preempted` are the Python lists naming its sequences.
    pub(super) fn new(
        py: Python<'_>,
        out: SchedulerOutput,
        request_ids: Bound<'_, PyList>,
        preempted: Bound<'_, PyList>,
    ) -> PyResult<Self> {
        let width = out.block_table_width;
        let rows = out.sequence_ids.len();
        let groups = out.num_groups;
        let block_tables = Array3::from_shape_vec((groups, rows, width), out.block_tables)
            .map_err(|err| to_py_err(py, Error::InvariantViolation(err.to_string())))?;
        let num_tokens = out.input_token_ids.len();
        let slot_mapping = Array2::from_shape_vec((groups, num_tokens), out.slot_mapping)
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
            request_ids: request_ids.unbind(),
            choice_indices: choice_indices.into_pyarray(py).unbind(),
            num_scheduled_tokens: out.num_scheduled_tokens.into_pyarray(py).unbind(),
            input_token_ids: out.input_token_ids.into_pyarray(py).unbind(),
            positions: out.positions.into_pyarray(py).unbind(),
            slot_mapping: slot_mapping.into_pyarray(py).unbind(),
            query_start_loc: out.query_start_loc.into_pyarray(py).unbind(),
            context_lens: out.context_lens.into_pyarray(py).unbind(),
            prompt_lens: out.prompt_lens.into_pyarray(py).unbind(),
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
            preempted: preempted.unbind(),
        })
    }
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

impl PyStepUpdates {
    /// The updates as columns; `request_ids` names each update's request.
    pub(super) fn new(
        py: Python<'_>,
        updates: &[SequenceUpdate],
        request_ids: impl IntoIterator<Item = Py<PyString>>,
    ) -> PyResult<Self> {
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
        Ok(PyStepUpdates {
            request_ids: PyList::new(py, request_ids)?.unbind(),
            choice_indices: choice_indices.into_pyarray(py).unbind(),
            token_ids: token_ids.into_pyarray(py).unbind(),
            logits_rows: logits_rows.into_pyarray(py).unbind(),
            finish_codes: finish_codes.into_pyarray(py).unbind(),
            num_cached_tokens: num_cached_tokens.into_pyarray(py).unbind(),
        })
    }
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

#[pymethods]
impl SchedulerStats {
    /// Used blocks over all blocks.
    #[getter(kv_cache_usage)]
    fn py_kv_cache_usage(&self) -> f64 {
        self.kv_cache_usage()
    }
}

#[pymethods]
impl KVCacheStats {
    fn __repr__(&self) -> String {
        format!(
            "KVCacheStats(num_blocks={}, num_used_blocks={}, num_cached_free_blocks={}, \
             num_free_blocks={}, prefix_cache_queries={}, prefix_cache_hits={}, num_evictions={})",
            self.num_blocks,
            self.num_used_blocks,
            self.num_cached_free_blocks,
            self.num_free_blocks,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.num_evictions
        )
    }
}
