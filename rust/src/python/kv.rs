//! `pagedrs.KVCacheManager`: the block tables, keyed by Python string ids.

use std::collections::HashMap;

use pyo3::prelude::*;

use super::{name_request, to_count, to_py_err, to_token_ids};
use crate::error::Error;
use crate::kv_cache_manager::{KVCacheManager, KVCacheStats, SequenceId};

/// Python face of `KVCacheManager`, keyed by string request ids.
#[pyclass(name = "KVCacheManager", module = "pagedrs._core")]
pub(super) struct PyKVCacheManager {
    /// The core.
    inner: KVCacheManager,
    /// Python request id to the core's handle of its sequence.
    request_id_to_handle: HashMap<String, SequenceId>,
}

impl PyKVCacheManager {
    fn handle(&self, request_id: &str) -> Result<SequenceId, Error> {
        self.request_id_to_handle
            .get(request_id)
            .copied()
            .ok_or_else(|| Error::UnknownRequest(request_id.to_owned()))
    }

    fn check_new(&self, request_id: &str) -> Result<(), Error> {
        if self.request_id_to_handle.contains_key(request_id) {
            return Err(Error::DuplicateRequest(request_id.to_owned()));
        }
        Ok(())
    }
}

#[pymethods]
impl PyKVCacheManager {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, enable_prefix_caching = true, namespace = ""))]
    fn new(
        py: Python<'_>,
        num_blocks: i64,
        block_size: i64,
        enable_prefix_caching: bool,
        namespace: &str,
    ) -> PyResult<Self> {
        let build = || -> Result<KVCacheManager, Error> {
            let num_blocks = to_count(num_blocks, "num_blocks")?;
            let block_size = to_count(block_size, "block_size")?;
            KVCacheManager::new(num_blocks, block_size, enable_prefix_caching, namespace)
        };
        Ok(PyKVCacheManager {
            inner: build().map_err(|err| to_py_err(py, err))?,
            request_id_to_handle: HashMap::new(),
        })
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.num_free_blocks()
    }

    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.inner.enable_prefix_caching()
    }

    #[getter]
    fn num_requests(&self) -> usize {
        self.inner.num_sequences()
    }

    fn usage(&self) -> f64 {
        self.inner.usage()
    }

    fn stats(&self) -> KVCacheStats {
        self.inner.stats()
    }

    fn __contains__(&self, request_id: &str) -> bool {
        self.request_id_to_handle.contains_key(request_id)
    }

    fn __repr__(&self) -> String {
        format!(
            "KVCacheManager(num_blocks={}, block_size={}, enable_prefix_caching={}, \
             num_free_blocks={}, num_requests={})",
            self.inner.num_blocks(),
            self.inner.block_size(),
            if self.inner.enable_prefix_caching() { "True" } else { "False" },
            self.inner.num_free_blocks(),
            self.inner.num_sequences()
        )
    }

    #[pyo3(signature = (request_id, prompt_token_ids, cache_salt = None))]
    fn add_request(
        &mut self,
        py: Python<'_>,
        request_id: &str,
        prompt_token_ids: Vec<i64>,
        cache_salt: Option<&str>,
    ) -> PyResult<()> {
        let result = (|| {
            let token_ids = to_token_ids(prompt_token_ids)?;
            self.check_new(request_id)?;
            let handle = self.inner.add_sequence(&token_ids, cache_salt)?;
            self.request_id_to_handle.insert(request_id.to_owned(), handle);
            Ok(())
        })();
        result.map_err(|err| to_py_err(py, name_request(err, request_id)))
    }

    fn append_token_ids(
        &mut self,
        py: Python<'_>,
        request_id: &str,
        token_ids: Vec<i64>,
    ) -> PyResult<()> {
        let result = (|| {
            let token_ids = to_token_ids(token_ids)?;
            self.inner.append_token_ids(self.handle(request_id)?, &token_ids)
        })();
        result.map_err(|err| to_py_err(py, name_request(err, request_id)))
    }

    fn get_computed_blocks(
        &mut self,
        py: Python<'_>,
        request_id: &str,
    ) -> PyResult<(Vec<u32>, usize)> {
        let result = (|| {
            let handle = self.handle(request_id)?;
            let num_tokens = self.inner.get_computed_blocks(handle)?;
            let blocks = self.inner.pending_hit_blocks(handle)?;
            Ok((blocks.into_iter().map(|block| block.0).collect(), num_tokens))
        })();
        result.map_err(|err| to_py_err(py, name_request(err, request_id)))
    }

    fn allocate_slots(
        &mut self,
        py: Python<'_>,
        request_id: &str,
        num_new_tokens: i64,
    ) -> PyResult<Option<Vec<(u32, u32)>>> {
        let result = (|| {
            let num_new_tokens = to_count(num_new_tokens, "num_new_tokens")?;
            let copies = self.inner.allocate_slots(self.handle(request_id)?, num_new_tokens)?;
            Ok(copies.map(|copies| copies.into_iter().map(|c| (c.src.0, c.dst.0)).collect()))
        })();
        result.map_err(|err| to_py_err(py, name_request(err, request_id)))
    }

    fn free(&mut self, py: Python<'_>, request_id: &str) -> PyResult<()> {
        let result = (|| {
            self.inner.free(self.handle(request_id)?)?;
            self.request_id_to_handle.remove(request_id);
            Ok(())
        })();
        result.map_err(|err| to_py_err(py, name_request(err, request_id)))
    }

    fn fork(&mut self, py: Python<'_>, parent_id: &str, child_id: &str) -> PyResult<()> {
        let parent = self.handle(parent_id).map_err(|err| to_py_err(py, err))?;
        let result = (|| {
            self.check_new(child_id)?;
            let child = self.inner.fork(parent)?;
            self.request_id_to_handle.insert(child_id.to_owned(), child);
            Ok(())
        })();
        result.map_err(|err| to_py_err(py, name_request(err, child_id)))
    }

    fn block_table(&self, py: Python<'_>, request_id: &str) -> PyResult<Vec<u32>> {
        let result = (|| Ok(self.inner.block_table(self.handle(request_id)?)?.to_vec()))();
        result
            .map(|blocks| blocks.into_iter().map(|block| block.0).collect())
            .map_err(|err| to_py_err(py, name_request(err, request_id)))
    }

    fn num_computed_tokens(&self, py: Python<'_>, request_id: &str) -> PyResult<usize> {
        let result = (|| self.inner.num_computed_tokens(self.handle(request_id)?))();
        result.map_err(|err| to_py_err(py, name_request(err, request_id)))
    }

    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.inner
            .pool()
            .check_invariants()
            .map_err(|violation| to_py_err(py, Error::InvariantViolation(violation)))
    }

    /// Test hook: keep only `bits` bits of every block key, forcing collisions.
    fn _force_hash_collisions(&mut self, bits: u32) {
        self.inner.force_hash_collisions_for_testing(bits);
    }
}
