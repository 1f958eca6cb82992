//! Per-request block tables over a shared `BlockPool`, with prefix reuse and fork.
//!
//! A request's tokens, as the manager sees them:
//!
//! ```text
//!   |<---------------------- token_ids (known) ---------------------->|
//!   |<--- prefix hit --->|<-- computed by the model -->|<- scheduled ->|
//!   |<-------------- num_computed_tokens ------------->|
//!   [ blk 0 ][ blk 1 ][ blk 2 ][ blk 3 ][ blk 4 ][ partial ]              block table
//!   |<----- full blocks: cached as soon as allocated ----->|
//! ```
//!
//! The life of a request: `add_request` (its prompt), `get_computed_blocks` (find its cached
//! prefix), `allocate_slots` for each chunk the scheduler runs, `append_token` for each
//! sampled token, and finally `free`. `fork` makes `n > 1` children that share every block.

use std::sync::Arc;

use crate::block_pool::{BlockId, BlockPool, BlockRef};
use crate::error::{Error, Result};
use crate::prefix_cache::{BlockHash, BlockHasher};

/// The core's handle for a request, handed out by `add_request` and `fork` (the Python
/// layer maps its string ids onto these). A slot index plus the slot's generation: slots
/// are reused, and a handle of a freed request never reaches the request in its old slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId {
    /// Slot in the manager's request table.
    index: u32,
    /// Uses of the slot before this one.
    generation: u32,
}

impl RequestId {
    /// The slot index: dense, so callers can keep per-request data in a `Vec`.
    pub fn index(self) -> usize {
        self.index as usize
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}.{}", self.index, self.generation)
    }
}

/// One entry of the request table.
#[derive(Debug, Clone, Default)]
struct RequestSlot {
    /// Bumped when the slot's request is freed.
    generation: u32,
    /// The request living here, if any.
    request: Option<RequestBlocks>,
}

/// Finds a live request in the table.
fn lookup(slots: &[RequestSlot], id: RequestId) -> Result<&RequestBlocks> {
    match slots.get(id.index()) {
        Some(RequestSlot { generation, request: Some(request) })
            if *generation == id.generation =>
        {
            Ok(request)
        }
        _ => Err(Error::UnknownRequest(id.to_string())),
    }
}

/// Finds a live request in the table, mutably.
fn lookup_mut(slots: &mut [RequestSlot], id: RequestId) -> Result<&mut RequestBlocks> {
    match slots.get_mut(id.index()) {
        Some(RequestSlot { generation, request: Some(request) })
            if *generation == id.generation =>
        {
            Ok(request)
        }
        _ => Err(Error::UnknownRequest(id.to_string())),
    }
}

/// A copy the runner must do before this step's forward pass: copy-on-write of a shared
/// partial block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    /// The shared block to copy from.
    pub src: BlockId,
    /// The request's new private block.
    pub dst: BlockId,
}

/// What one request holds in the KV cache.
#[derive(Debug, Clone)]
struct RequestBlocks {
    /// Every token known so far: prompt, then sampled tokens.
    token_ids: Vec<u32>,
    /// The request's `cache_salt`, shared with the first block it caches.
    cache_salt: Option<Arc<str>>,
    /// Where the request's key chain starts (namespace and salt).
    root_hash: BlockHash,
    /// Keys of the full blocks of `token_ids`, computed lazily as far as needed.
    block_hashes: Vec<BlockHash>,
    /// Physical blocks holding tokens `[i * block_size, (i + 1) * block_size)`.
    block_table: Vec<BlockId>,
    /// Tokens whose KV is in the cache or being computed in the current step.
    num_computed_tokens: usize,
    /// Leading blocks of `block_table` already offered to the prefix cache.
    num_cached_blocks: usize,
    /// The prefix found by `get_computed_blocks`, claimed by the first `allocate_slots`.
    pending_hit: Vec<BlockRef>,
    /// Tokens looked up by `get_computed_blocks`, counted as a prefix-cache query once the
    /// next `allocate_slots` succeeds (so a request retried every step counts once).
    pending_query_tokens: Option<usize>,
}

/// Running counts for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KVCacheStats {
    /// Total blocks in the pool.
    pub num_blocks: usize,
    /// Blocks referenced by at least one request.
    pub num_used_blocks: usize,
    /// Free blocks that still hold a reusable cached prefix.
    pub num_cached_free_blocks: usize,
    /// Blocks with no reference (cached-free included: they can be evicted).
    pub num_free_blocks: usize,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_cache_queries: u64,
    /// Of those, tokens found cached.
    pub prefix_cache_hits: u64,
    /// Cached blocks popped for reuse.
    pub num_evictions: u64,
}

/// Block tables of all live requests over one pool.
#[derive(Debug, Clone)]
pub struct KVCacheManager {
    /// The physical blocks.
    pool: BlockPool,
    /// Computes block keys; holds the namespace.
    hasher: BlockHasher,
    /// Whether full blocks are cached and looked up.
    enable_prefix_caching: bool,
    /// Requests by slot; see `RequestId`.
    slots: Vec<RequestSlot>,
    /// Empty slots, reused last-freed first.
    free_slots: Vec<u32>,
    /// Live requests.
    num_requests: usize,
    /// Prompt tokens looked up so far.
    prefix_cache_queries: u64,
    /// Tokens found cached so far.
    prefix_cache_hits: u64,
}

impl KVCacheManager {
    /// A manager of `num_blocks` blocks of `block_size` slots. `namespace` (the model's
    /// identity) keys the prefix cache so different models never share blocks.
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        enable_prefix_caching: bool,
        namespace: &str,
    ) -> Result<Self> {
        Ok(KVCacheManager {
            pool: BlockPool::new(num_blocks, block_size)?,
            hasher: BlockHasher::new(namespace),
            enable_prefix_caching,
            slots: Vec::new(),
            free_slots: Vec::new(),
            num_requests: 0,
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
        })
    }

    /// Token slots per block.
    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    /// Total blocks.
    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Blocks no request references (cached-free ones included).
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks()
    }

    /// Whether prefix caching is on.
    pub fn enable_prefix_caching(&self) -> bool {
        self.enable_prefix_caching
    }

    /// Fraction of blocks referenced by requests (cached-free blocks count as free).
    pub fn usage(&self) -> f64 {
        self.pool.num_used_blocks() as f64 / self.pool.num_blocks() as f64
    }

    /// Counts for metrics.
    pub fn stats(&self) -> KVCacheStats {
        KVCacheStats {
            num_blocks: self.pool.num_blocks(),
            num_used_blocks: self.pool.num_used_blocks(),
            num_cached_free_blocks: self.pool.num_cached_free_blocks(),
            num_free_blocks: self.pool.num_free_blocks(),
            prefix_cache_queries: self.prefix_cache_queries,
            prefix_cache_hits: self.prefix_cache_hits,
            num_evictions: self.pool.counters().num_evictions,
        }
    }

    /// The underlying pool (read-only: for invariant checks and tests).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Number of live requests.
    pub fn num_requests(&self) -> usize {
        self.num_requests
    }

    /// Whether `id` is live.
    pub fn contains(&self, id: RequestId) -> bool {
        lookup(&self.slots, id).is_ok()
    }

    /// Registers a request with its prompt and returns its handle. It holds no block until
    /// `allocate_slots`.
    pub fn add_request(
        &mut self,
        prompt_token_ids: &[u32],
        cache_salt: Option<&str>,
    ) -> Result<RequestId> {
        if prompt_token_ids.is_empty() {
            return Err(Error::InvalidArgument("the prompt must have at least one token".into()));
        }
        // Room for the prompt plus a block of decode tokens, so early steps don't reallocate.
        let num_blocks_hint = prompt_token_ids.len() / self.pool.block_size() + 2;
        let request = RequestBlocks {
            token_ids: prompt_token_ids.to_vec(),
            cache_salt: cache_salt.map(Arc::from),
            root_hash: self.hasher.root(cache_salt),
            block_hashes: Vec::with_capacity(num_blocks_hint),
            block_table: Vec::with_capacity(num_blocks_hint),
            num_computed_tokens: 0,
            num_cached_blocks: 0,
            pending_hit: Vec::new(),
            pending_query_tokens: None,
        };
        Ok(self.insert(request))
    }

    fn insert(&mut self, request: RequestBlocks) -> RequestId {
        let index = match self.free_slots.pop() {
            Some(index) => index,
            None => {
                self.slots.push(RequestSlot::default());
                (self.slots.len() - 1) as u32
            }
        };
        let slot = &mut self.slots[index as usize];
        slot.request = Some(request);
        self.num_requests += 1;
        RequestId { index, generation: slot.generation }
    }

    /// Appends sampled tokens to a request's known tokens.
    pub fn append_token_ids(&mut self, id: RequestId, token_ids: &[u32]) -> Result<()> {
        lookup_mut(&mut self.slots, id)?.token_ids.extend_from_slice(token_ids);
        Ok(())
    }

    /// Finds the longest cached prefix of a request that has no blocks yet, in full blocks
    /// and never covering its last known token (whose logits must be computed). Returns the
    /// number of cached tokens; the blocks are claimed by the next `allocate_slots`.
    pub fn get_computed_blocks(&mut self, id: RequestId) -> Result<usize> {
        let block_size = self.pool.block_size();
        let request = lookup_mut(&mut self.slots, id)?;
        if !request.block_table.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "request {id} already holds blocks; its prefix was looked up before its first \
                 allocation"
            )));
        }
        request.pending_hit.clear();
        request.pending_query_tokens = None;
        if !self.enable_prefix_caching {
            return Ok(0);
        }
        let num_tokens = request.token_ids.len();
        let max_hit_blocks = (num_tokens - 1) / block_size;
        ensure_block_hashes(&mut self.hasher, request, block_size, max_hit_blocks);
        request.pending_hit.reserve(max_hit_blocks);
        let mut parent = None;
        for (index, &hash) in request.block_hashes[..max_hit_blocks].iter().enumerate() {
            let tokens = &request.token_ids[index * block_size..(index + 1) * block_size];
            let salt = if index == 0 { request.cache_salt.as_deref() } else { None };
            let Some(block) = self.pool.lookup(hash, parent, salt, tokens) else {
                break;
            };
            let block_ref = self.pool.block_ref(block);
            request.pending_hit.push(block_ref);
            parent = Some(block_ref);
        }
        request.pending_query_tokens = Some(num_tokens);
        Ok(request.pending_hit.len() * block_size)
    }

    /// The blocks of the prefix hit found by the last `get_computed_blocks`.
    pub fn pending_hit_blocks(&self, id: RequestId) -> Result<Vec<BlockId>> {
        Ok(self.request(id)?.pending_hit.iter().map(|block| block.id).collect())
    }

    /// Reserves slots for the next `num_new_tokens` tokens of a request (after its computed
    /// tokens and, on the first call, after its prefix hit), marks them computed and caches
    /// the blocks they fill. Returns the copy-on-write copies the runner must do first, or
    /// `None`, changing nothing, when there are not enough free blocks.
    pub fn allocate_slots(
        &mut self,
        id: RequestId,
        num_new_tokens: usize,
    ) -> Result<Option<Vec<BlockCopy>>> {
        let block_size = self.pool.block_size();
        let request = lookup_mut(&mut self.slots, id)?;
        if request.pending_hit.iter().any(|&block| !self.pool.is_current(block)) {
            request.pending_hit.clear();
            return Err(Error::StalePrefixHit(id.to_string()));
        }
        let num_hit_tokens = request.pending_hit.len() * block_size;
        let first_new_token = request.num_computed_tokens + num_hit_tokens;
        let end = first_new_token + num_new_tokens;
        if end > request.token_ids.len() {
            return Err(Error::InvalidArgument(format!(
                "cannot allocate {num_new_tokens} tokens for request {id}: only {} of its \
                 tokens are known and {first_new_token} are computed",
                request.token_ids.len()
            )));
        }

        // Count what this needs before changing anything, so "no" leaves no trace.
        let num_held_blocks = request.block_table.len() + request.pending_hit.len();
        let num_new_blocks = end.div_ceil(block_size).saturating_sub(num_held_blocks);
        let write_block = first_new_token / block_size;
        let needs_copy = num_new_tokens > 0
            && first_new_token % block_size != 0
            && self.pool.ref_count(request.block_table[write_block]) > 1;
        let num_hit_blocks_now_free =
            request.pending_hit.iter().filter(|block| self.pool.ref_count(block.id) == 0).count();
        let num_available = self.pool.num_free_blocks() - num_hit_blocks_now_free;
        if num_new_blocks + usize::from(needs_copy) > num_available {
            return Ok(None);
        }

        // NOTE: hits are claimed before anything is popped, so the allocations below can't
        // evict the very blocks this request is about to reuse.
        if let Some(num_query_tokens) = request.pending_query_tokens.take() {
            self.prefix_cache_queries += num_query_tokens as u64;
            self.prefix_cache_hits += num_hit_tokens as u64;
        }
        if !request.pending_hit.is_empty() {
            for block in std::mem::take(&mut request.pending_hit) {
                self.pool.touch(block.id);
                request.block_table.push(block.id);
            }
            request.num_cached_blocks = request.block_table.len();
        }

        let mut copies = Vec::new();
        if needs_copy {
            let shared = request.block_table[write_block];
            let private = self.pool.allocate().expect("capacity was checked above");
            self.pool.release(shared)?;
            request.block_table[write_block] = private;
            copies.push(BlockCopy { src: shared, dst: private });
        }
        for _ in 0..num_new_blocks {
            let block = self.pool.allocate().expect("capacity was checked above");
            request.block_table.push(block);
        }
        request.num_computed_tokens = end;
        if self.enable_prefix_caching {
            cache_full_blocks(&mut self.pool, &mut self.hasher, request);
        }
        Ok(Some(copies))
    }

    /// Releases every block of a request, tail first (so chain tails are evicted before
    /// their heads), and forgets it. Cached blocks stay findable until evicted.
    pub fn free(&mut self, id: RequestId) -> Result<()> {
        lookup(&self.slots, id)?;
        let slot = &mut self.slots[id.index()];
        let request = slot.request.take().expect("looked up");
        slot.generation = slot.generation.wrapping_add(1);
        self.free_slots.push(id.index);
        self.num_requests -= 1;
        for &block in request.block_table.iter().rev() {
            self.pool.release(block)?;
        }
        Ok(())
    }

    /// Releases every block of a request, tail first, but keeps its tokens, so it can be
    /// allocated again from scratch (preemption by recompute; its prefix is often still
    /// cached when it resumes).
    pub fn reset(&mut self, id: RequestId) -> Result<()> {
        let request = lookup_mut(&mut self.slots, id)?;
        for &block in request.block_table.iter().rev() {
            self.pool.release(block)?;
        }
        request.block_table.clear();
        request.pending_hit.clear();
        request.pending_query_tokens = None;
        request.num_computed_tokens = 0;
        request.num_cached_blocks = 0;
        Ok(())
    }

    /// Makes a copy of `parent` that shares all its blocks by reference count, and returns
    /// its handle; the shared partial last block is copied when either side first writes
    /// into it.
    pub fn fork(&mut self, parent: RequestId) -> Result<RequestId> {
        let mut copy = self.request(parent)?.clone();
        copy.pending_hit.clear();
        copy.pending_query_tokens = None;
        for &block in &copy.block_table {
            self.pool.touch(block);
        }
        Ok(self.insert(copy))
    }

    /// The request's block table.
    pub fn block_table(&self, id: RequestId) -> Result<&[BlockId]> {
        Ok(&self.request(id)?.block_table)
    }

    /// Tokens of the request whose KV is in (or being written to) the cache.
    pub fn num_computed_tokens(&self, id: RequestId) -> Result<usize> {
        Ok(self.request(id)?.num_computed_tokens)
    }

    /// The request's known tokens and its block table, with one lookup.
    pub fn tokens_and_blocks(&self, id: RequestId) -> Result<(&[u32], &[BlockId])> {
        let request = self.request(id)?;
        Ok((&request.token_ids, &request.block_table))
    }

    /// All tokens known for the request.
    pub fn token_ids(&self, id: RequestId) -> Result<&[u32]> {
        Ok(&self.request(id)?.token_ids)
    }

    /// Test hook: see `BlockHasher::force_collisions_for_testing`. Affects requests added
    /// from now on.
    #[doc(hidden)]
    pub fn force_hash_collisions_for_testing(&mut self, bits: u32) {
        self.hasher.force_collisions_for_testing(bits);
    }

    fn request(&self, id: RequestId) -> Result<&RequestBlocks> {
        lookup(&self.slots, id)
    }
}

/// Extends `request.block_hashes` to cover its first `num_blocks` full blocks.
fn ensure_block_hashes(
    hasher: &mut BlockHasher,
    request: &mut RequestBlocks,
    block_size: usize,
    num_blocks: usize,
) {
    request.block_hashes.reserve(num_blocks.saturating_sub(request.block_hashes.len()));
    while request.block_hashes.len() < num_blocks {
        let index = request.block_hashes.len();
        let parent = request.block_hashes.last().copied().unwrap_or(request.root_hash);
        let tokens = &request.token_ids[index * block_size..(index + 1) * block_size];
        request.block_hashes.push(hasher.block(parent, tokens));
    }
}

/// Offers the request's newly computed full blocks to the prefix cache.
fn cache_full_blocks(pool: &mut BlockPool, hasher: &mut BlockHasher, request: &mut RequestBlocks) {
    let block_size = pool.block_size();
    let num_full_blocks = request.num_computed_tokens / block_size;
    if num_full_blocks <= request.num_cached_blocks {
        return;
    }
    ensure_block_hashes(hasher, request, block_size, num_full_blocks);
    for index in request.num_cached_blocks..num_full_blocks {
        let parent = (index > 0).then(|| pool.block_ref(request.block_table[index - 1]));
        let tokens = &request.token_ids[index * block_size..(index + 1) * block_size];
        // NOTE: the parent link is a pinned block reference, not a key. If a block with this
        // key is already cached (two requests computed it at once), this one stays
        // uncached, and so, in effect, do its descendants: a lost hit, never a wrong one.
        pool.cache(
            request.block_table[index],
            request.block_hashes[index],
            parent,
            request.cache_salt.as_ref(),
            tokens,
        );
    }
    request.num_cached_blocks = num_full_blocks;
}

#[cfg(test)]
#[path = "kv_cache_manager_tests.rs"]
mod tests;
