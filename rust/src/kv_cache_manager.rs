//! Per-sequence block tables over a shared `BlockPool`, with prefix reuse and fork.
//!
//! A sequence's tokens, as the manager sees them:
//!
//! ```text
//!   |<---------------------- token_ids (known) ---------------------->|
//!   |<--- prefix hit --->|<-- computed by the model -->|<- scheduled ->|
//!   |<-------------- num_computed_tokens ------------->|
//!   [ blk 0 ][ blk 1 ][ blk 2 ][ blk 3 ][ blk 4 ][ partial ]              block table
//!   |<----- full blocks: cached as soon as allocated ----->|
//! ```
//!
//! The life of a sequence: `add_sequence` (its prompt), `get_computed_blocks` (find its cached
//! prefix), `allocate_slots` for each chunk the scheduler runs, `append_token` for each
//! sampled token, and finally `free`. `fork` makes `n > 1` children that share every block.

use std::sync::Arc;

use crate::block_id::BlockId;
use crate::block_pool::{BlockPool, BlockRef};
use crate::error::{Error, Result};
use crate::prefix_cache::{BlockHash, BlockHasher};

/// The core's handle for a sequence, handed out by `add_sequence` and `fork` (the Python
/// layer maps its string ids onto these). A slot index plus the slot's generation: slots
/// are reused, and a handle of a freed sequence never reaches the sequence in its old slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceId {
    /// Slot in the manager's sequence table.
    index: u32,
    /// Uses of the slot before this one.
    generation: u32,
}

impl SequenceId {
    /// The slot index: dense, so callers can keep per-sequence data in a `Vec`.
    pub fn index(self) -> usize {
        self.index as usize
    }
}

impl std::fmt::Display for SequenceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}.{}", self.index, self.generation)
    }
}

/// One entry of the sequence table.
#[derive(Debug, Clone, Default)]
struct SequenceSlot {
    /// Bumped when the slot's sequence is freed.
    generation: u32,
    /// The sequence living here, if any.
    sequence: Option<SequenceBlocks>,
}

/// Finds a live sequence in the table.
fn lookup(slots: &[SequenceSlot], id: SequenceId) -> Result<&SequenceBlocks> {
    match slots.get(id.index()) {
        Some(SequenceSlot { generation, sequence: Some(sequence) })
            if *generation == id.generation =>
        {
            Ok(sequence)
        }
        _ => Err(Error::UnknownRequest(id.to_string())),
    }
}

/// Finds a live sequence in the table, mutably.
fn lookup_mut(slots: &mut [SequenceSlot], id: SequenceId) -> Result<&mut SequenceBlocks> {
    match slots.get_mut(id.index()) {
        Some(SequenceSlot { generation, sequence: Some(sequence) })
            if *generation == id.generation =>
        {
            Ok(sequence)
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
    /// The sequence's new private block.
    pub dst: BlockId,
}

/// What one sequence holds in the KV cache.
#[derive(Debug, Clone)]
struct SequenceBlocks {
    /// Every token known so far: prompt, then sampled tokens.
    token_ids: Vec<u32>,
    /// The sequence's `cache_salt`, shared with the first block it caches.
    cache_salt: Option<Arc<str>>,
    /// Where the sequence's key chain starts (namespace and salt).
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
    /// next `allocate_slots` succeeds (so a sequence retried every step counts once).
    pending_query_tokens: Option<usize>,
}

/// Running counts for metrics. Python reads it as `pagedrs._core.KVCacheStats`, these
/// fields as attributes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(
    feature = "python",
    pyo3::pyclass(name = "KVCacheStats", module = "pagedrs._core", frozen, get_all)
)]
pub struct KVCacheStats {
    /// Total blocks in the pool.
    pub num_blocks: usize,
    /// Blocks referenced by at least one sequence.
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

/// Block tables of all live sequences over one pool.
#[derive(Debug, Clone)]
pub struct KVCacheManager {
    /// The physical blocks.
    pool: BlockPool,
    /// Computes block keys; holds the namespace.
    hasher: BlockHasher,
    /// Whether full blocks are cached and looked up.
    enable_prefix_caching: bool,
    /// Sequences by slot; see `SequenceId`.
    slots: Vec<SequenceSlot>,
    /// Empty slots, reused last-freed first.
    free_slots: Vec<u32>,
    /// Live sequences.
    num_sequences: usize,
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
            num_sequences: 0,
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

    /// Blocks no sequence references (cached-free ones included).
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks()
    }

    /// Whether prefix caching is on.
    pub fn enable_prefix_caching(&self) -> bool {
        self.enable_prefix_caching
    }

    /// Fraction of blocks referenced by sequences (cached-free blocks count as free).
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

    /// Number of live sequences.
    pub fn num_sequences(&self) -> usize {
        self.num_sequences
    }

    /// Whether `id` is live.
    pub fn contains(&self, id: SequenceId) -> bool {
        lookup(&self.slots, id).is_ok()
    }

    /// Registers a sequence with its prompt and returns its handle. It holds no block until
    /// `allocate_slots`.
    pub fn add_sequence(
        &mut self,
        prompt_token_ids: &[u32],
        cache_salt: Option<&str>,
    ) -> Result<SequenceId> {
        if prompt_token_ids.is_empty() {
            return Err(Error::InvalidArgument("the prompt must have at least one token".into()));
        }
        // Room for the prompt plus a block of decode tokens, so early steps don't reallocate.
        let num_blocks_hint = prompt_token_ids.len() / self.pool.block_size() + 2;
        let sequence = SequenceBlocks {
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
        Ok(self.insert(sequence))
    }

    fn insert(&mut self, sequence: SequenceBlocks) -> SequenceId {
        let index = match self.free_slots.pop() {
            Some(index) => index,
            None => {
                self.slots.push(SequenceSlot::default());
                (self.slots.len() - 1) as u32
            }
        };
        let slot = &mut self.slots[index as usize];
        slot.sequence = Some(sequence);
        self.num_sequences += 1;
        SequenceId { index, generation: slot.generation }
    }

    /// Appends sampled tokens to a sequence's known tokens.
    pub fn append_token_ids(&mut self, id: SequenceId, token_ids: &[u32]) -> Result<()> {
        lookup_mut(&mut self.slots, id)?.token_ids.extend_from_slice(token_ids);
        Ok(())
    }

    /// Finds the longest cached prefix of a sequence that has no blocks yet, in full blocks
    /// and never covering its last known token (whose logits must be computed). Returns the
    /// number of cached tokens; the blocks are claimed by the next `allocate_slots`.
    pub fn get_computed_blocks(&mut self, id: SequenceId) -> Result<usize> {
        let block_size = self.pool.block_size();
        let sequence = lookup_mut(&mut self.slots, id)?;
        if !sequence.block_table.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "sequence {id} already holds blocks; its prefix was looked up before its first \
                 allocation"
            )));
        }
        sequence.pending_hit.clear();
        sequence.pending_query_tokens = None;
        if !self.enable_prefix_caching {
            return Ok(0);
        }
        let num_tokens = sequence.token_ids.len();
        let max_hit_blocks = (num_tokens - 1) / block_size;
        ensure_block_hashes(&mut self.hasher, sequence, block_size, max_hit_blocks);
        sequence.pending_hit.reserve(max_hit_blocks);
        let mut parent = None;
        for (index, &hash) in sequence.block_hashes[..max_hit_blocks].iter().enumerate() {
            let tokens = &sequence.token_ids[index * block_size..(index + 1) * block_size];
            let salt = if index == 0 { sequence.cache_salt.as_deref() } else { None };
            let Some(block) = self.pool.lookup(hash, parent, salt, tokens) else {
                break;
            };
            let block_ref = self.pool.block_ref(block);
            sequence.pending_hit.push(block_ref);
            parent = Some(block_ref);
        }
        sequence.pending_query_tokens = Some(num_tokens);
        Ok(sequence.pending_hit.len() * block_size)
    }

    /// The blocks of the prefix hit found by the last `get_computed_blocks`.
    pub fn pending_hit_blocks(&self, id: SequenceId) -> Result<Vec<BlockId>> {
        Ok(self.sequence(id)?.pending_hit.iter().map(|block| block.id).collect())
    }

    /// Reserves slots for the next `num_new_tokens` tokens of a sequence (after its computed
    /// tokens and, on the first call, after its prefix hit), marks them computed and caches
    /// the blocks they fill. Returns the copy-on-write copies the runner must do first, or
    /// `None`, changing nothing, when there are not enough free blocks.
    pub fn allocate_slots(
        &mut self,
        id: SequenceId,
        num_new_tokens: usize,
    ) -> Result<Option<Vec<BlockCopy>>> {
        self.allocate_slots_with_drafts(id, num_new_tokens, 0)
    }

    /// `allocate_slots`, plus slots for `num_draft_tokens` proposed tokens after the new
    /// ones. Proposals are not known tokens: they are not marked computed and never cached
    /// until `accept_drafts` says which of them were verified.
    pub fn allocate_slots_with_drafts(
        &mut self,
        id: SequenceId,
        num_new_tokens: usize,
        num_draft_tokens: usize,
    ) -> Result<Option<Vec<BlockCopy>>> {
        let block_size = self.pool.block_size();
        let sequence = lookup_mut(&mut self.slots, id)?;
        if sequence.pending_hit.iter().any(|&block| !self.pool.is_current(block)) {
            sequence.pending_hit.clear();
            return Err(Error::StalePrefixHit(id.to_string()));
        }
        let num_hit_tokens = sequence.pending_hit.len() * block_size;
        let first_new_token = sequence.num_computed_tokens + num_hit_tokens;
        let end = first_new_token + num_new_tokens;
        if end > sequence.token_ids.len() {
            return Err(Error::InvalidArgument(format!(
                "cannot allocate {num_new_tokens} tokens for sequence {id}: only {} of its \
                 tokens are known and {first_new_token} are computed",
                sequence.token_ids.len()
            )));
        }

        // Count what this needs before changing anything, so "no" leaves no trace.
        let num_held_blocks = sequence.block_table.len() + sequence.pending_hit.len();
        let num_new_blocks =
            (end + num_draft_tokens).div_ceil(block_size).saturating_sub(num_held_blocks);
        let write_block = first_new_token / block_size;
        // NOTE: proposals never reach a held block past the write block: a sequence holds
        // none (`accept_drafts` releases them), so this copy covers every shared write.
        let needs_copy = num_new_tokens > 0
            && !first_new_token.is_multiple_of(block_size)
            && self.pool.ref_count(sequence.block_table[write_block]) > 1;
        let num_hit_blocks_now_free =
            sequence.pending_hit.iter().filter(|block| self.pool.ref_count(block.id) == 0).count();
        let num_available = self.pool.num_free_blocks() - num_hit_blocks_now_free;
        if num_new_blocks + usize::from(needs_copy) > num_available {
            return Ok(None);
        }

        // NOTE: hits are claimed before anything is popped, so the allocations below can't
        // evict the very blocks this sequence is about to reuse.
        if let Some(num_query_tokens) = sequence.pending_query_tokens.take() {
            self.prefix_cache_queries += num_query_tokens as u64;
            self.prefix_cache_hits += num_hit_tokens as u64;
        }
        if !sequence.pending_hit.is_empty() {
            for block in std::mem::take(&mut sequence.pending_hit) {
                self.pool.touch(block.id);
                sequence.block_table.push(block.id);
            }
            sequence.num_cached_blocks = sequence.block_table.len();
        }

        let mut copies = Vec::new();
        if needs_copy {
            let shared = sequence.block_table[write_block];
            let private = self.pool.allocate().expect("capacity was checked above");
            self.pool.release(shared)?;
            sequence.block_table[write_block] = private;
            copies.push(BlockCopy { src: shared, dst: private });
        }
        for _ in 0..num_new_blocks {
            let block = self.pool.allocate().expect("capacity was checked above");
            sequence.block_table.push(block);
        }
        sequence.num_computed_tokens = end;
        if self.enable_prefix_caching {
            cache_full_blocks(&mut self.pool, &mut self.hasher, sequence);
        }
        Ok(Some(copies))
    }

    /// After a speculative step: `num_accepted` of the proposals scheduled after the
    /// sequence's computed tokens were verified (and appended with `append_token_ids`), so
    /// their KV is kept and their full blocks cached; blocks past the known tokens, which
    /// held only rejected proposals, are released.
    pub fn accept_drafts(&mut self, id: SequenceId, num_accepted: usize) -> Result<()> {
        let block_size = self.pool.block_size();
        let sequence = lookup_mut(&mut self.slots, id)?;
        let num_computed = sequence.num_computed_tokens + num_accepted;
        if num_computed >= sequence.token_ids.len() {
            return Err(Error::InvalidArgument(format!(
                "sequence {id} cannot accept {num_accepted} proposals: {} of its {} tokens are \
                 computed and its last token never is",
                sequence.num_computed_tokens,
                sequence.token_ids.len()
            )));
        }
        sequence.num_computed_tokens = num_computed;
        let num_needed_blocks = sequence.token_ids.len().div_ceil(block_size);
        while sequence.block_table.len() > num_needed_blocks {
            let block = sequence.block_table.pop().expect("longer than needed");
            self.pool.release(block)?;
        }
        if self.enable_prefix_caching {
            cache_full_blocks(&mut self.pool, &mut self.hasher, sequence);
        }
        Ok(())
    }

    /// Releases every block of a sequence, tail first (so chain tails are evicted before
    /// their heads), and forgets it. Cached blocks stay findable until evicted.
    pub fn free(&mut self, id: SequenceId) -> Result<()> {
        lookup(&self.slots, id)?;
        let slot = &mut self.slots[id.index()];
        let sequence = slot.sequence.take().expect("looked up");
        slot.generation = slot.generation.wrapping_add(1);
        self.free_slots.push(id.index);
        self.num_sequences -= 1;
        for &block in sequence.block_table.iter().rev() {
            self.pool.release(block)?;
        }
        Ok(())
    }

    /// Releases every block of a sequence, tail first, but keeps its tokens, so it can be
    /// allocated again from scratch (preemption by recompute; its prefix is often still
    /// cached when it resumes).
    pub fn reset(&mut self, id: SequenceId) -> Result<()> {
        let sequence = lookup_mut(&mut self.slots, id)?;
        for &block in sequence.block_table.iter().rev() {
            self.pool.release(block)?;
        }
        sequence.block_table.clear();
        sequence.pending_hit.clear();
        sequence.pending_query_tokens = None;
        sequence.num_computed_tokens = 0;
        sequence.num_cached_blocks = 0;
        Ok(())
    }

    /// Makes a copy of `parent` that shares all its blocks by reference count, and returns
    /// its handle; the shared partial last block is copied when either side first writes
    /// into it.
    pub fn fork(&mut self, parent: SequenceId) -> Result<SequenceId> {
        let mut copy = self.sequence(parent)?.clone();
        copy.pending_hit.clear();
        copy.pending_query_tokens = None;
        for &block in &copy.block_table {
            self.pool.touch(block);
        }
        Ok(self.insert(copy))
    }

    /// The sequence's block table.
    pub fn block_table(&self, id: SequenceId) -> Result<&[BlockId]> {
        Ok(&self.sequence(id)?.block_table)
    }

    /// Tokens of the sequence whose KV is in (or being written to) the cache.
    pub fn num_computed_tokens(&self, id: SequenceId) -> Result<usize> {
        Ok(self.sequence(id)?.num_computed_tokens)
    }

    /// The sequence's known tokens and its block table, with one lookup.
    pub fn tokens_and_blocks(&self, id: SequenceId) -> Result<(&[u32], &[BlockId])> {
        let sequence = self.sequence(id)?;
        Ok((&sequence.token_ids, &sequence.block_table))
    }

    /// All tokens known for the sequence.
    pub fn token_ids(&self, id: SequenceId) -> Result<&[u32]> {
        Ok(&self.sequence(id)?.token_ids)
    }

    /// Test hook: see `BlockHasher::force_collisions_for_testing`. Affects sequences added
    /// from now on.
    #[doc(hidden)]
    pub fn force_hash_collisions_for_testing(&mut self, bits: u32) {
        self.hasher.force_collisions_for_testing(bits);
    }

    fn sequence(&self, id: SequenceId) -> Result<&SequenceBlocks> {
        lookup(&self.slots, id)
    }
}

/// Extends `sequence.block_hashes` to cover its first `num_blocks` full blocks.
fn ensure_block_hashes(
    hasher: &mut BlockHasher,
    sequence: &mut SequenceBlocks,
    block_size: usize,
    num_blocks: usize,
) {
    sequence.block_hashes.reserve(num_blocks.saturating_sub(sequence.block_hashes.len()));
    while sequence.block_hashes.len() < num_blocks {
        let index = sequence.block_hashes.len();
        let parent = sequence.block_hashes.last().copied().unwrap_or(sequence.root_hash);
        let tokens = &sequence.token_ids[index * block_size..(index + 1) * block_size];
        sequence.block_hashes.push(hasher.block(parent, tokens));
    }
}

/// Offers the sequence's newly computed full blocks to the prefix cache.
fn cache_full_blocks(
    pool: &mut BlockPool,
    hasher: &mut BlockHasher,
    sequence: &mut SequenceBlocks,
) {
    let block_size = pool.block_size();
    let num_full_blocks = sequence.num_computed_tokens / block_size;
    if num_full_blocks <= sequence.num_cached_blocks {
        return;
    }
    ensure_block_hashes(hasher, sequence, block_size, num_full_blocks);
    for index in sequence.num_cached_blocks..num_full_blocks {
        let parent = (index > 0).then(|| pool.block_ref(sequence.block_table[index - 1]));
        let tokens = &sequence.token_ids[index * block_size..(index + 1) * block_size];
        // NOTE: the parent link is a pinned block reference, not a key. If a block with this
        // key is already cached (two sequences computed it at once), this one stays
        // uncached, and so, in effect, do its descendants: a lost hit, never a wrong one.
        pool.cache(
            sequence.block_table[index],
            sequence.block_hashes[index],
            parent,
            sequence.cache_salt.as_ref(),
            tokens,
        );
    }
    sequence.num_cached_blocks = num_full_blocks;
}

#[cfg(test)]
#[path = "kv_cache_manager_tests.rs"]
mod tests;
