//! `pagedrs.Scheduler`: the per-step scheduler, with its batch as numpy arrays.
//!
//! The constructor reads its settings off Python objects (an `EngineConfig` and a
//! `SpeculativeConfig`) by attribute, as `FromPyObject` structs: every setting is declared
//! once, on the Python side, and converted and checked here before the core sees it.

use std::collections::HashMap;

use numpy::PyReadonlyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};

use super::outputs::{PySchedulerOutput, PyStepUpdates};
use super::{name_request, to_count, to_py_err, to_token_ids};
use crate::batch::SequenceUpdate;
use crate::error::Error;
use crate::metrics::SchedulerStats;
use crate::scheduler::{RequestParams, Scheduler, SchedulerConfig, SchedulingPolicy};
use crate::sequence::{FinishReason, RequestHandle, StopConditions};
use crate::speculative::{SpeculativeConfig, SpeculativeMethod};

/// The scheduler's settings, read by attribute from `pagedrs.config.EngineConfig` (any
/// object with these attributes; others are ignored).
#[derive(FromPyObject)]
struct EngineSettings {
    /// Token slots per KV block.
    block_size: i64,
    /// Token budget of one step.
    max_num_batched_tokens: i64,
    /// Most sequences running at once.
    max_num_seqs: i64,
    /// `"fcfs"` or `"priority"`.
    scheduling_policy: String,
    /// Whether full blocks are cached and reused across requests.
    enable_prefix_caching: bool,
    /// Most tokens one prefill computes in one step (`None`: no cap beyond the budget).
    long_prefill_token_threshold: Option<i64>,
    /// Most requests with an unfinished prefill at once.
    max_num_partial_prefills: i64,
    /// Most seats one request holds while another is live (`None`: no share).
    max_seqs_per_request: Option<i64>,
}

/// Speculative decoding's settings, read by attribute from
/// `pagedrs.spec_decode.SpeculativeConfig` with its defaults already resolved.
#[derive(FromPyObject)]
struct SpeculativeSettings {
    /// `"ngram"`, `"suffix"` or `"draft_model"`.
    method: String,
    /// Most tokens proposed per sequence and step (`k`).
    num_speculative_tokens: i64,
    /// Shortest suffix the n-gram proposer matches.
    prompt_lookup_min: i64,
    /// Longest suffix the n-gram proposer matches.
    prompt_lookup_max: i64,
    /// Deepest path of the suffix tries.
    suffix_decoding_max_tree_depth: i64,
    /// Suffix decoding proposes a continuation while its probability is at least this.
    suffix_decoding_min_token_prob: f64,
    /// Suffix decoding proposes at most this many tokens per token matched.
    suffix_decoding_max_spec_factor: f64,
    /// Finished requests whose outputs suffix decoding keeps.
    suffix_decoding_max_cached_requests: i64,
    /// Running sequences at which no sequence speculates (`None` or 0: never steps aside).
    disable_by_batch_size: Option<i64>,
}

impl SpeculativeSettings {
    /// The core's settings.
    fn to_core(&self) -> Result<SpeculativeConfig, Error> {
        let method = match self.method.as_str() {
            "ngram" => SpeculativeMethod::Ngram {
                min_n: to_count(self.prompt_lookup_min, "prompt_lookup_min")?,
                max_n: to_count(self.prompt_lookup_max, "prompt_lookup_max")?,
            },
            "suffix" => SpeculativeMethod::Suffix {
                max_depth: to_count(
                    self.suffix_decoding_max_tree_depth,
                    "suffix_decoding_max_tree_depth",
                )?,
                min_token_prob: self.suffix_decoding_min_token_prob,
                max_spec_factor: self.suffix_decoding_max_spec_factor,
                max_cached_requests: to_count(
                    self.suffix_decoding_max_cached_requests,
                    "suffix_decoding_max_cached_requests",
                )?,
            },
            "draft_model" => SpeculativeMethod::DraftModel,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "speculative method must be \"ngram\", \"suffix\" or \"draft_model\", \
                     got {other:?}"
                )))
            }
        };
        let disable_by_batch_size = match self.disable_by_batch_size {
            None | Some(0) => None,
            Some(size) => Some(to_count(size, "disable_by_batch_size")?),
        };
        Ok(SpeculativeConfig {
            method,
            num_speculative_tokens: to_count(
                self.num_speculative_tokens,
                "num_speculative_tokens",
            )?,
            disable_by_batch_size,
        })
    }
}

fn parse_policy(policy: &str) -> Result<SchedulingPolicy, Error> {
    match policy {
        "fcfs" => Ok(SchedulingPolicy::Fcfs),
        "priority" => Ok(SchedulingPolicy::Priority),
        other => Err(Error::InvalidArgument(format!(
            "scheduling_policy must be \"fcfs\" or \"priority\", got {other:?}"
        ))),
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

/// Python face of `Scheduler`.
#[pyclass(name = "Scheduler", module = "pagedrs._core")]
pub(super) struct PyScheduler {
    /// The core.
    inner: Scheduler,
    /// Each live request's id (by the core's request handle) as a Python string, so
    /// outputs reuse one object.
    handle_to_py_id: HashMap<RequestHandle, Py<PyString>>,
    /// Handles of requests the caller finished (`finish_request`) since the last
    /// `update_from_output`, whose ids are forgotten there.
    finished_handles: Vec<RequestHandle>,
}

impl PyScheduler {
    fn py_id(&self, py: Python<'_>, handle: RequestHandle) -> Py<PyString> {
        match self.handle_to_py_id.get(&handle) {
            Some(id) => id.clone_ref(py),
            None => PyString::new(py, "").unbind(),
        }
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

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (
        config, *, num_blocks, max_model_len, namespace = "", speculative = None,
        kv_group_windows = None,
    ))]
    fn new(
        py: Python<'_>,
        config: EngineSettings,
        num_blocks: i64,
        max_model_len: i64,
        namespace: &str,
        speculative: Option<SpeculativeSettings>,
        kv_group_windows: Option<Vec<Option<i64>>>,
    ) -> PyResult<Self> {
        let build = || -> Result<Scheduler, Error> {
            let kv_group_windows = match kv_group_windows {
                None => vec![None],
                Some(windows) => windows
                    .into_iter()
                    .map(|window| window.map(|w| to_count(w, "kv_group_windows")).transpose())
                    .collect::<Result<_, _>>()?,
            };
            Scheduler::new(SchedulerConfig {
                num_blocks: to_count(num_blocks, "num_blocks")?,
                block_size: to_count(config.block_size, "block_size")?,
                enable_prefix_caching: config.enable_prefix_caching,
                namespace: namespace.to_owned(),
                kv_group_windows,
                max_num_batched_tokens: to_count(
                    config.max_num_batched_tokens,
                    "max_num_batched_tokens",
                )?,
                max_num_seqs: to_count(config.max_num_seqs, "max_num_seqs")?,
                max_model_len: to_count(max_model_len, "max_model_len")?,
                policy: parse_policy(&config.scheduling_policy)?,
                long_prefill_token_threshold: config
                    .long_prefill_token_threshold
                    .map(|t| to_count(t, "long_prefill_token_threshold"))
                    .transpose()?,
                max_num_partial_prefills: to_count(
                    config.max_num_partial_prefills,
                    "max_num_partial_prefills",
                )?,
                max_seqs_per_request: config
                    .max_seqs_per_request
                    .map(|share| to_count(share, "max_seqs_per_request"))
                    .transpose()?,
                speculative: speculative.as_ref().map(SpeculativeSettings::to_core).transpose()?,
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
        prompt_logprobs = false,
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
        prompt_logprobs: bool,
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
                prompt_logprobs,
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
        let request_ids = PyList::new(py, ids)?;
        let preempted = out
            .preempted
            .iter()
            .filter_map(|&id| self.inner.sequence_of(id))
            .map(|(handle, choice_index)| (self.py_id(py, handle), choice_index));
        let preempted = PyList::new(py, preempted)?;
        PySchedulerOutput::new(py, out, request_ids, preempted)
    }

    /// Appends the sampled tokens (one per `logits_indices` row of the last `schedule`) and
    /// returns, as columns, one row per appended token (a speculating sequence may get
    /// several, in order) or per sequence that `schedule` ended. `draft_token_ids`: the
    /// proposals the caller wrote into the batch under the `draft_model` method, in row order.
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
        let request_ids = updates.iter().map(|update| self.py_id(py, update.request));
        let step_updates = PyStepUpdates::new(py, &updates, request_ids)?;
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

    /// Blocks one choice of a live request holds in each KV layer group.
    #[pyo3(signature = (request_id, index = 0))]
    fn held_blocks(&self, py: Python<'_>, request_id: &str, index: i64) -> PyResult<Vec<usize>> {
        let result = (|| self.inner.held_blocks(request_id, to_count(index, "index")?))();
        result.map_err(|err| to_py_err(py, err))
    }

    /// KV layer groups (the leading dimension of a step's `slot_mapping` and
    /// `block_tables`).
    #[getter]
    fn num_kv_groups(&self) -> usize {
        self.inner.kv_cache().num_groups()
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

    fn stats(&self) -> SchedulerStats {
        self.inner.stats()
    }

    /// Raises `InternalError` if the scheduler or its KV cache is inconsistent.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.check_invariants().map_err(|err| to_py_err(py, err))
    }
}
