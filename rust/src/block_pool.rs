//! The physical KV blocks: reference counts, the LRU free queue and the prefix cache map.
//!
//! Invariants (checked by `check_invariants` after every mutation in tests):
//! - a block is in the free queue iff its ref count is 0;
//! - every cached block is in `hash_to_block` under its own key, and the map holds
//!   nothing else;
//! - `num_cached_free` counts exactly the cached blocks whose ref count is 0.
//!
//! A freed cached block keeps its key and stays findable until `allocate` pops it from the
//! front of the free queue for reuse: that is an eviction.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::Arc;

use crate::block_id::BlockId;
use crate::error::{Error, Result};
use crate::free_queue::FreeBlockQueue;
use crate::prefix_cache::{BlockHash, BuildPrehashed};

/// A block id pinned to one use of the block: stale once the block is handed out again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRef {
    /// The physical block.
    pub id: BlockId,
    /// How many times the block had been handed out when this reference was taken.
    pub generation: u32,
}

/// What a cached block remembers so a hit can be confirmed without trusting the key.
#[derive(Debug, Clone)]
struct CacheEntry {
    /// Its key in `hash_to_block`.
    hash: BlockHash,
    /// The block holding the previous block of the chain when this one was computed;
    /// `None` for a chain's first block.
    parent: Option<BlockRef>,
    /// The request's `cache_salt`; recorded on first blocks only (later blocks inherit it
    /// through `parent`).
    salt: Option<Arc<str>>,
}

/// Per-block state read less often than the ref count.
#[derive(Debug, Clone, Default)]
struct BlockState {
    /// Bumped each time the block is handed out by `allocate`, which invalidates every
    /// `BlockRef` taken before.
    generation: u32,
    /// Set while the block is in the prefix cache.
    cache: Option<CacheEntry>,
}

/// Counts the pool keeps as it runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolCounters {
    /// Cached blocks popped for reuse (their prefix is gone).
    pub num_evictions: u64,
}

/// `num_blocks` blocks of `block_size` token slots each.
#[derive(Debug, Clone)]
pub struct BlockPool {
    /// Token slots per block.
    block_size: usize,
    /// Number of block-table entries pointing at each block, indexed by block id. Kept
    /// apart from `blocks` so the per-step copy-on-write check touches 4 bytes, not a line.
    ref_counts: Vec<u32>,
    /// State of each block, indexed by block id.
    blocks: Vec<BlockState>,
    /// Blocks with ref count 0, front evicted first.
    free_queue: FreeBlockQueue,
    /// Cached full blocks by key. One block per key: a second block with the same key
    /// (computed concurrently) is simply not cached.
    hash_to_block: HashMap<BlockHash, BlockId, BuildPrehashed>,
    /// Token ids of every cached block, `block_size` per block, indexed by block id; the
    /// ground truth a hit is confirmed against.
    block_token_ids: Vec<u32>,
    /// Cached blocks with ref count 0 (free, but still holding a reusable prefix).
    num_cached_free: usize,
    /// Running counts.
    counters: PoolCounters,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` slots.
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self> {
        if num_blocks == 0 {
            return Err(Error::InvalidArgument("num_blocks must be at least 1".into()));
        }
        if block_size == 0 {
            return Err(Error::InvalidArgument("block_size must be at least 1".into()));
        }
        if num_blocks > BlockId::NULL.index() {
            return Err(Error::InvalidArgument(format!(
                "num_blocks must be at most {}, got {num_blocks}",
                BlockId::NULL.index()
            )));
        }
        Ok(BlockPool {
            block_size,
            ref_counts: vec![0; num_blocks],
            blocks: vec![BlockState::default(); num_blocks],
            free_queue: FreeBlockQueue::with_all_blocks(num_blocks),
            hash_to_block: HashMap::default(),
            block_token_ids: vec![0; num_blocks * block_size],
            num_cached_free: 0,
            counters: PoolCounters::default(),
        })
    }

    /// Token slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Total number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks with ref count 0 (including cached-free ones, which can be evicted).
    pub fn num_free_blocks(&self) -> usize {
        self.free_queue.len()
    }

    /// Free blocks that still hold a cached prefix.
    pub fn num_cached_free_blocks(&self) -> usize {
        self.num_cached_free
    }

    /// Blocks referenced by at least one sequence.
    pub fn num_used_blocks(&self) -> usize {
        self.blocks.len() - self.free_queue.len()
    }

    /// Blocks currently in the prefix cache (used or free).
    pub fn num_cached_blocks(&self) -> usize {
        self.hash_to_block.len()
    }

    /// Running counts.
    pub fn counters(&self) -> PoolCounters {
        self.counters
    }

    /// The block's ref count.
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_counts[block.index()]
    }

    /// Whether the block is in the prefix cache.
    pub fn is_cached(&self, block: BlockId) -> bool {
        self.blocks[block.index()].cache.is_some()
    }

    /// A reference to the block's current use.
    pub fn block_ref(&self, block: BlockId) -> BlockRef {
        BlockRef { id: block, generation: self.blocks[block.index()].generation }
    }

    /// Whether `block_ref` still names the same use of its block.
    pub fn is_current(&self, block_ref: BlockRef) -> bool {
        self.blocks[block_ref.id.index()].generation == block_ref.generation
    }

    /// Takes the least recently freed block, evicting its cached prefix if it has one, and
    /// hands it out with ref count 1. `None` when every block is in use.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let block = self.free_queue.pop_front()?;
        let state = &mut self.blocks[block.index()];
        if let Some(entry) = state.cache.take() {
            self.hash_to_block.remove(&entry.hash);
            self.num_cached_free -= 1;
            self.counters.num_evictions += 1;
        }
        state.generation = state.generation.wrapping_add(1);
        self.ref_counts[block.index()] = 1;
        Some(block)
    }

    /// Adds a reference to `block`, taking it out of the free queue if it was free (a
    /// prefix hit on a cached-free block).
    pub fn touch(&mut self, block: BlockId) {
        let ref_count = &mut self.ref_counts[block.index()];
        if *ref_count == 0 {
            self.free_queue.remove(block);
            if self.blocks[block.index()].cache.is_some() {
                self.num_cached_free -= 1;
            }
        }
        *ref_count += 1;
    }

    /// Drops a reference. At zero the block joins the back of the free queue, keeping its
    /// cached prefix (if any) until it is evicted.
    pub fn release(&mut self, block: BlockId) -> Result<()> {
        let ref_count = &mut self.ref_counts[block.index()];
        if *ref_count == 0 {
            return Err(Error::RefCountUnderflow(block));
        }
        *ref_count -= 1;
        if *ref_count == 0 {
            if self.blocks[block.index()].cache.is_some() {
                self.num_cached_free += 1;
            }
            self.free_queue.push_back(block);
        }
        Ok(())
    }

    /// Finds the cached block with key `hash` and confirms it really holds `token_ids`
    /// computed after `parent` (or, for a first block, under `salt`).
    pub fn lookup(
        &self,
        hash: BlockHash,
        parent: Option<BlockRef>,
        salt: Option<&str>,
        token_ids: &[u32],
    ) -> Option<BlockId> {
        let block = *self.hash_to_block.get(&hash)?;
        let entry = self.blocks[block.index()].cache.as_ref()?;
        let same_context = match (parent, entry.parent) {
            (Some(wanted), Some(stored)) => wanted == stored && self.is_current(stored),
            (None, None) => entry.salt.as_deref() == salt,
            _ => false,
        };
        (same_context && self.cached_token_ids(block) == token_ids).then_some(block)
    }

    /// Registers a full, in-use block under `hash`. Returns false (and caches nothing)
    /// when another block already holds that key.
    pub fn cache(
        &mut self,
        block: BlockId,
        hash: BlockHash,
        parent: Option<BlockRef>,
        salt: Option<&Arc<str>>,
        token_ids: &[u32],
    ) -> bool {
        debug_assert_eq!(token_ids.len(), self.block_size);
        debug_assert!(self.ref_counts[block.index()] > 0, "only in-use blocks are cached");
        if self.blocks[block.index()].cache.is_some() {
            return false;
        }
        match self.hash_to_block.entry(hash) {
            Entry::Occupied(_) => return false,
            Entry::Vacant(slot) => slot.insert(block),
        };
        let start = block.index() * self.block_size;
        self.block_token_ids[start..start + self.block_size].copy_from_slice(token_ids);
        let salt = if parent.is_none() { salt.cloned() } else { None };
        self.blocks[block.index()].cache = Some(CacheEntry { hash, parent, salt });
        true
    }

    fn cached_token_ids(&self, block: BlockId) -> &[u32] {
        let start = block.index() * self.block_size;
        &self.block_token_ids[start..start + self.block_size]
    }

    /// Free blocks from next-to-evict to most recently freed.
    pub fn free_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.free_queue.iter()
    }

    /// Checks every invariant in the module docs; returns the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut num_free = 0;
        let mut num_cached = 0;
        let mut num_cached_free = 0;
        for (index, (state, &ref_count)) in self.blocks.iter().zip(&self.ref_counts).enumerate() {
            let block = BlockId(index as u32);
            let in_queue = self.free_queue.contains(block);
            if in_queue != (ref_count == 0) {
                return Err(format!(
                    "block {index}: ref count {ref_count} but in free queue = {in_queue}"
                ));
            }
            num_free += usize::from(in_queue);
            if let Some(entry) = &state.cache {
                num_cached += 1;
                num_cached_free += usize::from(ref_count == 0);
                if self.hash_to_block.get(&entry.hash) != Some(&block) {
                    return Err(format!("cached block {index} is not in the map under its key"));
                }
            }
        }
        if self.free_queue.iter().count() != self.free_queue.len()
            || num_free != self.free_queue.len()
        {
            return Err(format!(
                "free queue length {} disagrees with {num_free} blocks at ref count 0",
                self.free_queue.len()
            ));
        }
        if num_cached != self.hash_to_block.len() {
            return Err(format!(
                "{} keys in the map but {num_cached} cached blocks",
                self.hash_to_block.len()
            ));
        }
        if num_cached_free != self.num_cached_free {
            return Err(format!(
                "counted {} cached-free blocks, found {num_cached_free}",
                self.num_cached_free
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u128) -> BlockHash {
        BlockHash(n)
    }

    #[test]
    fn rejects_zero_blocks_or_zero_block_size() {
        assert!(matches!(BlockPool::new(0, 16), Err(Error::InvalidArgument(_))));
        assert!(matches!(BlockPool::new(4, 0), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn allocate_hands_out_every_block_once_then_none() {
        let mut pool = BlockPool::new(3, 2).unwrap();
        let got: Vec<_> = (0..3).map(|_| pool.allocate().unwrap().0).collect();
        assert_eq!(got, vec![0, 1, 2]);
        assert_eq!(pool.allocate(), None);
        assert_eq!(pool.num_used_blocks(), 3);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn releasing_below_zero_is_an_error_not_a_panic() {
        let mut pool = BlockPool::new(2, 2).unwrap();
        let block = pool.allocate().unwrap();
        pool.release(block).unwrap();
        assert_eq!(pool.release(block), Err(Error::RefCountUnderflow(block)));
        pool.check_invariants().unwrap();
    }

    #[test]
    fn freed_cached_block_is_found_again_until_evicted() {
        let mut pool = BlockPool::new(2, 2).unwrap();
        let block = pool.allocate().unwrap();
        assert!(pool.cache(block, key(7), None, None, &[1, 2]));
        pool.release(block).unwrap();
        assert_eq!(pool.num_cached_free_blocks(), 1);
        assert_eq!(pool.lookup(key(7), None, None, &[1, 2]), Some(block));
        pool.check_invariants().unwrap();

        // Block 1 is at the front, then our cached block: two allocations evict it.
        pool.allocate().unwrap();
        assert_eq!(pool.lookup(key(7), None, None, &[1, 2]), Some(block));
        assert_eq!(pool.allocate(), Some(block));
        assert_eq!(pool.lookup(key(7), None, None, &[1, 2]), None);
        assert_eq!(pool.counters().num_evictions, 1);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn hit_is_confirmed_by_tokens_parent_and_salt() {
        let mut pool = BlockPool::new(4, 2).unwrap();
        let salt: Arc<str> = Arc::from("tenant");
        let first = pool.allocate().unwrap();
        assert!(pool.cache(first, key(1), None, Some(&salt), &[1, 2]));
        let parent = pool.block_ref(first);
        let second = pool.allocate().unwrap();
        assert!(pool.cache(second, key(2), Some(parent), None, &[3, 4]));

        assert_eq!(pool.lookup(key(1), None, Some("tenant"), &[1, 2]), Some(first));
        assert_eq!(pool.lookup(key(1), None, None, &[1, 2]), None, "salt differs");
        assert_eq!(pool.lookup(key(1), None, Some("tenant"), &[1, 9]), None, "tokens differ");
        assert_eq!(pool.lookup(key(2), Some(parent), None, &[3, 4]), Some(second));
        let other_parent = BlockRef { id: BlockId(3), generation: 0 };
        assert_eq!(pool.lookup(key(2), Some(other_parent), None, &[3, 4]), None);
        assert_eq!(pool.lookup(key(2), None, None, &[3, 4]), None, "not a first block");
    }

    #[test]
    fn second_block_with_a_taken_key_is_not_cached() {
        let mut pool = BlockPool::new(2, 1).unwrap();
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        assert!(pool.cache(a, key(5), None, None, &[1]));
        assert!(!pool.cache(b, key(5), None, None, &[1]));
        assert!(!pool.is_cached(b));
        pool.check_invariants().unwrap();
    }
}
