//! The PyO3 binding: a thin layer over the plain-Rust core. Python arguments are converted
//! and validated here first; every `Error` becomes one of the exception classes declared in
//! `pagedrs/errors.py`. Nothing here panics across the boundary.

mod kv;
mod outputs;
mod scheduler;
mod structured;

use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyTuple, PyType};

use crate::error::Error;
use crate::kv_cache_manager::KVCacheStats;
use crate::metrics::SchedulerStats;
use crate::sequence::FinishReason;
use crate::speculative::MAX_SPECULATIVE_TOKENS;

/// Raises `Error` as the matching `pagedrs.errors` class (or, should that module fail to
/// import, as the standard class it derives from, so callers catching `ValueError` or
/// `KeyError` still do).
pub(super) fn to_py_err(py: Python<'_>, err: Error) -> PyErr {
    let class_name = match err {
        Error::InvalidArgument(_) => "InvalidArgumentError",
        Error::UnknownRequest(_) => "UnknownRequestError",
        Error::DuplicateRequest(_) => "DuplicateRequestError",
        Error::RefCountUnderflow(_) | Error::StalePrefixHit(_) | Error::InvariantViolation(_) => {
            "InternalError"
        }
        // Grammar ids and matcher handles are not requests: a plain KeyError.
        Error::UnknownGrammar(_) | Error::UnknownMatcher(_) => {
            return PyKeyError::new_err(err.to_string())
        }
    };
    let message = err.to_string();
    let class = py
        .import("pagedrs.errors")
        .and_then(|module| module.getattr(class_name))
        .and_then(|class| class.cast_into::<PyType>().map_err(PyErr::from));
    match (class, err) {
        (Ok(class), _) => PyErr::from_type(class, message),
        (Err(_), Error::InvalidArgument(_) | Error::DuplicateRequest(_)) => {
            PyValueError::new_err(message)
        }
        (Err(_), Error::UnknownRequest(_)) => PyKeyError::new_err(message),
        (Err(_), _) => PyRuntimeError::new_err(message),
    }
}

/// Replaces the core's numeric request id in an error by the caller's string id.
pub(super) fn name_request(err: Error, request_id: &str) -> Error {
    match err {
        Error::UnknownRequest(_) => Error::UnknownRequest(request_id.to_owned()),
        Error::DuplicateRequest(_) => Error::DuplicateRequest(request_id.to_owned()),
        Error::StalePrefixHit(_) => Error::StalePrefixHit(request_id.to_owned()),
        other => other,
    }
}

/// Converts a Python int to a count, refusing negatives with a ValueError-family error.
pub(super) fn to_count(value: i64, what: &str) -> Result<usize, Error> {
    usize::try_from(value)
        .map_err(|_| Error::InvalidArgument(format!("{what} must be >= 0, got {value}")))
}

/// Converts token ids, refusing values outside `0..2**32`.
pub(super) fn to_token_ids(values: Vec<i64>) -> Result<Vec<u32>, Error> {
    values
        .into_iter()
        .map(|value| {
            u32::try_from(value).map_err(|_| {
                Error::InvalidArgument(format!("token ids must be in [0, 2**32), got {value}"))
            })
        })
        .collect()
}

/// The compiled core of pagedrs. Private: import from `pagedrs`.
#[pymodule]
fn _core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<kv::PyKVCacheManager>()?;
    module.add_class::<KVCacheStats>()?;
    module.add_class::<scheduler::PyScheduler>()?;
    module.add_class::<outputs::PySchedulerOutput>()?;
    module.add_class::<SchedulerStats>()?;
    module.add_class::<outputs::PyStepUpdates>()?;
    module.add_class::<structured::PyGrammarMatchers>()?;
    // `StepUpdates.finish_codes` index this: code `c > 0` is `FINISH_REASONS[c - 1]`.
    let finish_reasons = FinishReason::ALL.map(FinishReason::as_str);
    module.add("FINISH_REASONS", PyTuple::new(module.py(), finish_reasons)?)?;
    module.add("MAX_SPECULATIVE_TOKENS", MAX_SPECULATIVE_TOKENS)?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
