//! `pagedrs.GrammarMatchers`: structured-output masks, filled with the GIL released.

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray2};
use pyo3::prelude::*;

use super::to_py_err;
use crate::error::Error;
use crate::structured::{GrammarId, GrammarKind, GrammarMatchers, MatcherHandle};

/// Python face of `GrammarMatchers`.
#[pyclass(name = "GrammarMatchers", module = "pagedrs._core")]
pub(super) struct PyGrammarMatchers {
    /// The core.
    inner: GrammarMatchers,
}

/// Converts a Python int to a matcher handle; a negative one names no matcher.
fn to_handle(value: i64) -> Result<MatcherHandle, Error> {
    u64::try_from(value)
        .map(MatcherHandle)
        .map_err(|_| Error::InvalidArgument(format!("matcher handles are >= 0, got {value}")))
}

#[pymethods]
impl PyGrammarMatchers {
    #[new]
    #[pyo3(signature = (token_bytes, eos_token_id, vocab_size, *, max_cached_grammars = 256))]
    fn new(
        py: Python<'_>,
        token_bytes: Vec<Vec<u8>>,
        eos_token_id: i64,
        vocab_size: i64,
        max_cached_grammars: i64,
    ) -> PyResult<Self> {
        let build = move || -> Result<GrammarMatchers, Error> {
            let eos_token_id = u32::try_from(eos_token_id).map_err(|_| {
                Error::InvalidArgument(format!("eos_token_id must be >= 0, got {eos_token_id}"))
            })?;
            let vocab_size = super::to_count(vocab_size, "vocab_size")?;
            let max_cached_grammars = super::to_count(max_cached_grammars, "max_cached_grammars")?;
            GrammarMatchers::new(token_bytes, eos_token_id, vocab_size)?
                .with_max_cached_grammars(max_cached_grammars)
        };
        // Building the token trie takes tens of milliseconds on a large vocabulary.
        let inner = py.detach(build).map_err(|err| to_py_err(py, err))?;
        Ok(PyGrammarMatchers { inner })
    }

    fn compile(&mut self, py: Python<'_>, kind: &str, spec: &str) -> PyResult<u64> {
        let kind = GrammarKind::parse(kind).map_err(|err| to_py_err(py, err))?;
        let inner = &mut self.inner;
        let compiled = py.detach(|| inner.compile(kind, spec));
        compiled.map(|grammar_id| grammar_id.0).map_err(|err| to_py_err(py, err))
    }

    fn add(&mut self, py: Python<'_>, grammar_id: i64) -> PyResult<u64> {
        let grammar_id = u64::try_from(grammar_id)
            .map_err(|_| Error::InvalidArgument(format!("grammar ids are >= 0, got {grammar_id}")))
            .and_then(|grammar_id| self.inner.add(GrammarId(grammar_id)));
        grammar_id.map(|handle| handle.0).map_err(|err| to_py_err(py, err))
    }

    fn fill_bitmask<'py>(
        &mut self,
        py: Python<'py>,
        handles: Vec<i64>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let handles: Vec<MatcherHandle> = handles
            .into_iter()
            .map(to_handle)
            .collect::<Result<_, _>>()
            .map_err(|err| to_py_err(py, err))?;
        let num_words = self.inner.num_mask_words();
        let inner = &mut self.inner;
        let filled = py.detach(|| {
            let mut bitmask = vec![0i32; handles.len() * num_words];
            inner.fill_bitmask(&handles, &mut bitmask).map(|()| bitmask)
        });
        let bitmask = filled.map_err(|err| to_py_err(py, err))?;
        let bitmask = Array2::from_shape_vec((handles.len(), num_words), bitmask)
            .expect("one row of num_words per handle");
        Ok(bitmask.into_pyarray(py))
    }

    fn advance(&mut self, py: Python<'_>, handle: i64, token_id: i64) -> PyResult<bool> {
        let token_id = u32::try_from(token_id).map_err(|_| {
            Error::InvalidArgument(format!("token ids must be in [0, 2**32), got {token_id}"))
        });
        let advanced =
            token_id.and_then(|token_id| self.inner.advance(to_handle(handle)?, token_id));
        advanced.map_err(|err| to_py_err(py, err))
    }

    fn is_finished(&self, py: Python<'_>, handle: i64) -> PyResult<bool> {
        to_handle(handle)
            .and_then(|handle| self.inner.is_finished(handle))
            .map_err(|err| to_py_err(py, err))
    }

    fn error(&self, py: Python<'_>, handle: i64) -> PyResult<Option<String>> {
        to_handle(handle)
            .and_then(|handle| self.inner.error(handle))
            .map_err(|err| to_py_err(py, err))
    }

    fn remove(&mut self, py: Python<'_>, handle: i64) -> PyResult<()> {
        to_handle(handle)
            .and_then(|handle| self.inner.remove(handle))
            .map_err(|err| to_py_err(py, err))
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    #[getter]
    fn eos_token_id(&self) -> u32 {
        self.inner.eos_token_id()
    }

    #[getter]
    fn num_cached_grammars(&self) -> usize {
        self.inner.num_cached_grammars()
    }

    #[getter]
    fn num_compiled(&self) -> u64 {
        self.inner.stats().num_compiled
    }

    #[getter]
    fn cache_hits(&self) -> u64 {
        self.inner.stats().cache_hits
    }

    #[getter]
    fn compile_seconds_total(&self) -> f64 {
        self.inner.stats().compile_seconds_total
    }

    #[getter]
    fn mask_seconds_total(&self) -> f64 {
        self.inner.stats().mask_seconds_total
    }

    #[getter]
    fn num_masks(&self) -> u64 {
        self.inner.stats().num_masks
    }

    fn __repr__(&self) -> String {
        format!(
            "GrammarMatchers(vocab_size={}, eos_token_id={}, num_matchers={}, num_cached_grammars={})",
            self.inner.vocab_size(),
            self.inner.eos_token_id(),
            self.inner.len(),
            self.inner.num_cached_grammars()
        )
    }
}
