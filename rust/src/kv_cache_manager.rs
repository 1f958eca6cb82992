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

use smallvec::SmallVec;

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

/// What one layer group of a sequence holds (see "Layer groups" in the module docs).
#[derive(Debug, Clone, Default)]
pub(crate) struct GroupBlocks {
    /// Physical blocks holding tokens `[i * block_size, (i + 1) * block_size)` of this
    /// group's layers; `BlockId::NULL` where a block fell out of the group's window and was
    /// released.
    table: Vec<BlockId>,
    /// Leading entries of `table` released (all `NULL`).
    num_skipped: usize,
    /// Leading blocks of `table` already offered to the prefix cache.
    num_cached_blocks: usize,
    /// The last block offered to the prefix cache, as it was then: the parent of the next
    /// one in group 0's chain, still right after that block was released.
    last_cached: Option<BlockRef>,
}

/// The prefix `get_computed_blocks` found, until the next `allocate_slots` claims it.
#[derive(Debug, Clone)]
struct PendingHit {
    /// Blocks of the prefix: every group's hit ends there.
    num_blocks: usize,
    /// Group 0's last block of it (the parent of the next block that group caches).
    tail: BlockRef,
    /// Per group: the index of the first block it claims (those before are out of its
    /// window), and the blocks from there to the end of the prefix.
    groups: SmallVec<[(usize, Vec<BlockRef>); 1]>,
}

impl GroupBlocks {
    /// The group's block table (`BlockId::NULL` for released blocks).
    pub(crate) fn table(&self) -> &[BlockId] {
        &self.table
    }

    /// Index of the first held block: every entry before it is `BlockId::NULL`, none after.
    pub(crate) fn first_held(&self) -> usize {
        self.num_skipped
    }

    /// Blocks the group holds now.
    fn num_held(&self) -> usize {
        self.table.len() - self.num_skipped
    }

    /// The held blocks, tail first.
    fn held_rev(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.table[self.num_skipped..].iter().rev().copied()
    }
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
    /// Keys of the full blocks of `token_ids`, computed lazily as far as needed (group 0's;
    /// every other group keys its blocks by these mixed with its index).
    block_hashes: Vec<BlockHash>,
    /// One entry per layer group of the manager (inline for one group).
    groups: SmallVec<[GroupBlocks; 1]>,
    /// Tokens whose KV is in the cache or being computed in the current step.
    num_computed_tokens: usize,
    /// The prefix found by `get_computed_blocks`, claimed by the first `allocate_slots`
    /// (boxed: most sequences never have one, and every step walks them all).
    pending_hit: Option<Box<PendingHit>>,
    /// Tokens looked up by `get_computed_blocks`, counted as a prefix-cache query once the
    /// next `allocate_slots` succeeds (so a sequence retried every step counts once).
    pending_query_tokens: Option<usize>,
}

impl SequenceBlocks {
    fn clear_pending_hit(&mut self) {
        self.pending_hit = None;
    }

    fn num_pending_hit_blocks(&self) -> usize {
        self.pending_hit.as_ref().map_or(0, |hit| hit.num_blocks)
    }
}

/// The first block a query at `position` still reads under `window` (`None`: all of them).
/// Blocks before it hold only keys the query (and every later one) no longer sees.
fn first_visible_block(window: Option<usize>, position: usize, block_size: usize) -> usize {
    window.map_or(0, |window| (position + 1).saturating_sub(window) / block_size)
}

/// The pool key of a block of group `group` whose chain key is `hash`: group 0 uses the
/// chain key itself; later groups mix in their index, so each group caches its own blocks.
fn group_key(hash: BlockHash, group: usize) -> BlockHash {
    const MIX: u128 = 0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835;
    BlockHash(hash.0 ^ (group as u128).wrapping_mul(MIX))
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
    /// The window of each layer group (`None`: full attention); group 0 first.
    group_windows: Vec<Option<usize>>,
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
    /// A manager of `num_blocks` blocks of `block_size` slots, one full-attention layer
    /// group. `namespace` (the model's identity) keys the prefix cache so different models
    /// never share blocks.
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        enable_prefix_caching: bool,
        namespace: &str,
    ) -> Result<Self> {
        Self::with_groups(num_blocks, block_size, enable_prefix_caching, namespace, &[None])
    }

    /// `new`, with one layer group per entry of `group_windows`: its window, or `None` for
    /// full attention. With more than one group, group 0 must be full attention (the other
    /// groups' cached blocks are confirmed against its chain).
    pub fn with_groups(
        num_blocks: usize,
        block_size: usize,
        enable_prefix_caching: bool,
        namespace: &str,
        group_windows: &[Option<usize>],
    ) -> Result<Self> {
        check_group_windows(group_windows)?;
        Ok(KVCacheManager {
            pool: BlockPool::new(num_blocks, block_size)?,
            hasher: BlockHasher::new(namespace),
            enable_prefix_caching,
            group_windows: group_windows.to_vec(),
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

    /// Layer groups, each with its own block table per sequence.
    pub fn num_groups(&self) -> usize {
        self.group_windows.len()
    }

    /// Each layer group's window (`None`: full attention).
    pub fn group_windows(&self) -> &[Option<usize>] {
        &self.group_windows
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
        let group =
            GroupBlocks { table: Vec::with_capacity(num_blocks_hint), ..Default::default() };
        let sequence = SequenceBlocks {
            token_ids: prompt_token_ids.to_vec(),
            cache_salt: cache_salt.map(Arc::from),
            root_hash: self.hasher.root(cache_salt),
            block_hashes: Vec::with_capacity(num_blocks_hint),
            groups: SmallVec::from_elem(group, self.group_windows.len()),
            num_computed_tokens: 0,
            pending_hit: None,
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
    ///
    /// With several layer groups, a prefix is a hit only where every group has the blocks it
    /// still reads: group 0 (full attention) the whole chain, a sliding group those inside
    /// its window of the prefix's end.
    pub fn get_computed_blocks(&mut self, id: SequenceId) -> Result<usize> {
        let block_size = self.pool.block_size();
        let sequence = lookup_mut(&mut self.slots, id)?;
        if sequence.groups.iter().any(|group| !group.table.is_empty()) {
            return Err(Error::InvalidArgument(format!(
                "sequence {id} already holds blocks; its prefix was looked up before its first \
                 allocation"
            )));
        }
        sequence.clear_pending_hit();
        sequence.pending_query_tokens = None;
        if !self.enable_prefix_caching {
            return Ok(0);
        }
        let num_tokens = sequence.token_ids.len();
        let max_hit_blocks = (num_tokens - 1) / block_size;
        ensure_block_hashes(&mut self.hasher, sequence, block_size, max_hit_blocks);

        // Group 0: the chain, each block confirmed against its parent.
        let mut chain: Vec<BlockRef> = Vec::with_capacity(max_hit_blocks);
        for (index, &hash) in sequence.block_hashes[..max_hit_blocks].iter().enumerate() {
            let tokens = &sequence.token_ids[index * block_size..(index + 1) * block_size];
            let salt = if index == 0 { sequence.cache_salt.as_deref() } else { None };
            let Some(block) = self.pool.lookup(hash, chain.last().copied(), salt, tokens) else {
                break;
            };
            chain.push(self.pool.block_ref(block));
        }
        let mut num_hit = chain.len();

        // Later groups: each block confirmed against group 0's block of the same index. A
        // block a group still reads but lacks ends the prefix just before it.
        let mut found: Vec<Vec<Option<BlockRef>>> =
            Vec::with_capacity(self.group_windows.len() - 1);
        for group in 1..self.group_windows.len() {
            let blocks = (0..num_hit)
                .map(|index| {
                    let hash = group_key(sequence.block_hashes[index], group);
                    let tokens = &sequence.token_ids[index * block_size..(index + 1) * block_size];
                    let block = self.pool.lookup(hash, Some(chain[index]), None, tokens)?;
                    Some(self.pool.block_ref(block))
                })
                .collect();
            found.push(blocks);
        }
        loop {
            let before = num_hit;
            for (blocks, &window) in found.iter().zip(&self.group_windows[1..]) {
                let first = first_visible_block(window, num_hit * block_size, block_size);
                if let Some(missing) = (first..num_hit).rev().find(|&index| blocks[index].is_none())
                {
                    num_hit = missing;
                }
            }
            if num_hit == before {
                break;
            }
        }

        if num_hit > 0 {
            let tail = chain[num_hit - 1];
            let first =
                first_visible_block(self.group_windows[0], num_hit * block_size, block_size)
                    .min(num_hit);
            chain.truncate(num_hit);
            chain.drain(..first);
            let mut groups = SmallVec::with_capacity(self.group_windows.len());
            groups.push((first, chain));
            for (blocks, &window) in found.iter().zip(&self.group_windows[1..]) {
                let first =
                    first_visible_block(window, num_hit * block_size, block_size).min(num_hit);
                let claimed = blocks[first..num_hit].iter().map(|block| block.expect("a hit"));
                groups.push((first, claimed.collect()));
            }
            sequence.pending_hit = Some(Box::new(PendingHit { num_blocks: num_hit, tail, groups }));
        }
        sequence.pending_query_tokens = Some(num_tokens);
        Ok(num_hit * block_size)
    }

    /// Group 0's blocks of the prefix hit found by the last `get_computed_blocks`.
    pub fn pending_hit_blocks(&self, id: SequenceId) -> Result<Vec<BlockId>> {
        let hit = self.sequence(id)?.pending_hit.as_ref();
        Ok(hit.map_or_else(Vec::new, |hit| hit.groups[0].1.iter().map(|block| block.id).collect()))
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
    ///
    /// First, in each sliding group, the blocks no query of this step (or any later one)
    /// reads are released: that is not undone when the answer is `None`.
    pub fn allocate_slots_with_drafts(
        &mut self,
        id: SequenceId,
        num_new_tokens: usize,
        num_draft_tokens: usize,
    ) -> Result<Option<Vec<BlockCopy>>> {
        let block_size = self.pool.block_size();
        let sequence = lookup_mut(&mut self.slots, id)?;
        let num_hit_blocks = sequence.num_pending_hit_blocks();
        let stale = sequence.pending_hit.as_ref().is_some_and(|hit| {
            hit.groups
                .iter()
                .any(|(_, blocks)| blocks.iter().any(|&block| !self.pool.is_current(block)))
        });
        if stale {
            sequence.clear_pending_hit();
            return Err(Error::StalePrefixHit(id.to_string()));
        }
        let first_new_token = sequence.num_computed_tokens + num_hit_blocks * block_size;
        let end = first_new_token + num_new_tokens;
        if end > sequence.token_ids.len() {
            return Err(Error::InvalidArgument(format!(
                "cannot allocate {num_new_tokens} tokens for sequence {id}: only {} of its \
                 tokens are known and {first_new_token} are computed",
                sequence.token_ids.len()
            )));
        }
        for (group, &window) in sequence.groups.iter_mut().zip(&self.group_windows) {
            if window.is_none() {
                continue;
            }
            let first =
                first_visible_block(window, first_new_token, block_size).min(group.table.len());
            for index in group.num_skipped..first {
                let block = std::mem::replace(&mut group.table[index], BlockId::NULL);
                self.pool.release(block)?;
            }
            group.num_skipped = group.num_skipped.max(first);
        }

        // Count what this needs before changing anything, so "no" leaves no trace.
        let num_table_blocks = (end + num_draft_tokens).div_ceil(block_size);
        let write_block = first_new_token / block_size;
        // NOTE: proposals never reach a held block past the write block: a sequence holds
        // none (`accept_drafts` releases them), so this copy covers every shared write.
        let writes_into_a_block = num_new_tokens > 0 && !first_new_token.is_multiple_of(block_size);
        let mut num_needed = 0;
        let mut num_hit_blocks_now_free = 0;
        // Bit g: group g's write block is shared and must be copied first.
        let mut copy_groups: u64 = 0;
        for (index, group) in sequence.groups.iter().enumerate() {
            num_needed += num_table_blocks.saturating_sub(group.table.len() + num_hit_blocks);
            if writes_into_a_block && self.pool.ref_count(group.table[write_block]) > 1 {
                copy_groups |= 1 << index;
                num_needed += 1;
            }
        }
        if let Some(hit) = &sequence.pending_hit {
            for (_, blocks) in &hit.groups {
                num_hit_blocks_now_free +=
                    blocks.iter().filter(|block| self.pool.ref_count(block.id) == 0).count();
            }
        }
        if num_needed > self.pool.num_free_blocks() - num_hit_blocks_now_free {
            return Ok(None);
        }

        // NOTE: hits are claimed before anything is popped, so the allocations below can't
        // evict the very blocks this sequence is about to reuse.
        if let Some(num_query_tokens) = sequence.pending_query_tokens.take() {
            self.prefix_cache_queries += num_query_tokens as u64;
            self.prefix_cache_hits += (num_hit_blocks * block_size) as u64;
        }
        if let Some(hit) = sequence.pending_hit.take() {
            for (group, (start, blocks)) in sequence.groups.iter_mut().zip(hit.groups) {
                group.table.resize(start, BlockId::NULL);
                group.num_skipped = start;
                for block in blocks {
                    self.pool.touch(block.id);
                    group.table.push(block.id);
                }
                group.num_cached_blocks = hit.num_blocks;
                group.last_cached = Some(hit.tail);
            }
        }

        let mut copies = Vec::new();
        for (index, group) in sequence.groups.iter_mut().enumerate() {
            if copy_groups & (1 << index) != 0 {
                let shared = group.table[write_block];
                let private = self.pool.allocate().expect("capacity was checked above");
                self.pool.release(shared)?;
                group.table[write_block] = private;
                copies.push(BlockCopy { src: shared, dst: private });
            }
            while group.table.len() < num_table_blocks {
                let block = self.pool.allocate().expect("capacity was checked above");
                group.table.push(block);
            }
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
        for group in &mut sequence.groups {
            while group.table.len() > num_needed_blocks.max(group.num_skipped) {
                let block = group.table.pop().expect("longer than needed");
                self.pool.release(block)?;
            }
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
        for group in sequence.groups.iter().rev() {
            for block in group.held_rev() {
                self.pool.release(block)?;
            }
        }
        Ok(())
    }

    /// Releases every block of a sequence, tail first, but keeps its tokens, so it can be
    /// allocated again from scratch (preemption by recompute; its prefix is often still
    /// cached when it resumes).
    pub fn reset(&mut self, id: SequenceId) -> Result<()> {
        let sequence = lookup_mut(&mut self.slots, id)?;
        for group in sequence.groups.iter_mut().rev() {
            for block in group.held_rev() {
                self.pool.release(block)?;
            }
            group.table.clear();
            group.num_skipped = 0;
            group.num_cached_blocks = 0;
            group.last_cached = None;
        }
        sequence.clear_pending_hit();
        sequence.pending_query_tokens = None;
        sequence.num_computed_tokens = 0;
        Ok(())
    }

    /// Makes a copy of `parent` that shares all its blocks by reference count, and returns
    /// its handle; the shared partial last block is copied when either side first writes
    /// into it.
    pub fn fork(&mut self, parent: SequenceId) -> Result<SequenceId> {
        let mut copy = self.sequence(parent)?.clone();
        copy.clear_pending_hit();
        copy.pending_query_tokens = None;
        for group in &copy.groups {
            for block in group.held_rev() {
                self.pool.touch(block);
            }
        }
        Ok(self.insert(copy))
    }

    /// The sequence's block table in group 0 (the only one of a one-group manager).
    pub fn block_table(&self, id: SequenceId) -> Result<&[BlockId]> {
        Ok(&self.sequence(id)?.groups[0].table)
    }

    /// The sequence's block table in each layer group (`BlockId::NULL` for blocks released
    /// out of a window).
    pub fn block_tables(&self, id: SequenceId) -> Result<impl Iterator<Item = &[BlockId]>> {
        Ok(self.sequence(id)?.groups.iter().map(GroupBlocks::table))
    }

    /// Blocks the sequence holds in each layer group.
    pub fn num_held_blocks(&self, id: SequenceId) -> Result<Vec<usize>> {
        Ok(self.sequence(id)?.groups.iter().map(GroupBlocks::num_held).collect())
    }

    /// Tokens of the sequence whose KV is in (or being written to) the cache.
    pub fn num_computed_tokens(&self, id: SequenceId) -> Result<usize> {
        Ok(self.sequence(id)?.num_computed_tokens)
    }

    /// The sequence's known tokens and its layer groups' blocks, with one lookup.
    pub(crate) fn tokens_and_groups(&self, id: SequenceId) -> Result<(&[u32], &[GroupBlocks])> {
        let sequence = self.sequence(id)?;
        Ok((&sequence.token_ids, &sequence.groups))
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

/// The most KV layer groups a manager takes (`allocate_slots` keeps one bit per group).
pub const MAX_GROUPS: usize = 64;

/// Checks the layer groups' windows: at least one group (at most `MAX_GROUPS`), every window
/// at least one token,
/// and group 0 full attention when there are others.
pub(crate) fn check_group_windows(group_windows: &[Option<usize>]) -> Result<()> {
    if group_windows.is_empty() {
        return Err(Error::InvalidArgument("the KV cache needs at least one layer group".into()));
    }
    if group_windows.len() > MAX_GROUPS {
        return Err(Error::InvalidArgument(format!(
            "the KV cache takes at most {MAX_GROUPS} layer groups, got {}",
            group_windows.len()
        )));
    }
    if group_windows.contains(&Some(0)) {
        return Err(Error::InvalidArgument("a layer group's window must be at least 1".into()));
    }
    if group_windows.len() > 1 && group_windows[0].is_some() {
        return Err(Error::InvalidArgument(
            "with several layer groups, group 0 must be full attention (the others' cached \
             blocks are confirmed against its chain)"
                .into(),
        ));
    }
    Ok(())
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

/// Offers the sequence's newly computed full blocks to the prefix cache: group 0's as a
/// chain (each block's parent is the block before it), every other group's each under
/// group 0's block of the same index.
fn cache_full_blocks(
    pool: &mut BlockPool,
    hasher: &mut BlockHasher,
    sequence: &mut SequenceBlocks,
) {
    let block_size = pool.block_size();
    let num_full_blocks = sequence.num_computed_tokens / block_size;
    if num_full_blocks <= sequence.groups[0].num_cached_blocks {
        return;
    }
    ensure_block_hashes(hasher, sequence, block_size, num_full_blocks);
    let (anchor, others) = sequence.groups.split_first_mut().expect("at least one group");
    for index in anchor.num_cached_blocks..num_full_blocks {
        let block = anchor.table[index];
        if block == BlockId::NULL {
            // Released before it was full (a window shorter than a block): the chain ends.
            anchor.last_cached = None;
            continue;
        }
        let tokens = &sequence.token_ids[index * block_size..(index + 1) * block_size];
        // NOTE: the parent link is a pinned block reference, not a key. If a block with this
        // key is already cached (two sequences computed it at once), this one stays
        // uncached, and so, in effect, do its descendants: a lost hit, never a wrong one.
        let parent = anchor.last_cached;
        let chained = index == 0 || parent.is_some();
        if chained {
            let salt = sequence.cache_salt.as_ref();
            pool.cache(block, sequence.block_hashes[index], parent, salt, tokens);
        }
        anchor.last_cached = chained.then(|| pool.block_ref(block));
    }
    for (offset, group) in others.iter_mut().enumerate() {
        for index in group.num_cached_blocks..num_full_blocks {
            let (block, anchor_block) = (group.table[index], anchor.table[index]);
            if block == BlockId::NULL || anchor_block == BlockId::NULL {
                continue;
            }
            let tokens = &sequence.token_ids[index * block_size..(index + 1) * block_size];
            let key = group_key(sequence.block_hashes[index], offset + 1);
            pool.cache(block, key, Some(pool.block_ref(anchor_block)), None, tokens);
        }
        group.num_cached_blocks = num_full_blocks;
    }
    anchor.num_cached_blocks = num_full_blocks;
}

#[cfg(test)]
#[path = "kv_cache_manager_tests.rs"]
mod tests;
