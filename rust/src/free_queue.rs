//! The free-block queue: an intrusive doubly linked list over block ids.
//!
//! Why not a `VecDeque`? A freed block that still holds a cached prefix can be *hit* again
//! while it sits in the queue, and then it must leave the queue from the middle. The links
//! live in two arrays indexed by block id, so push-back, pop-front and remove-from-middle
//! are all O(1) with no allocation after construction.
//!
//! Order is the eviction order: the front is evicted first (least recently freed). Callers
//! free a sequence's blocks tail-first, so within one chain the tail is evicted before the
//! head, and a shorter prefix outlives a longer one.

use crate::block_id::BlockId;

/// Links of one block while it is in the queue.
#[derive(Debug, Clone, Copy, Default)]
struct Links {
    /// The block before this one (towards the front), if any.
    prev: Option<BlockId>,
    /// The block after this one (towards the back), if any.
    next: Option<BlockId>,
    /// Whether the block is in the queue at all; the links are meaningless otherwise.
    in_queue: bool,
}

/// An LRU queue of free block ids with O(1) removal from the middle.
#[derive(Debug, Clone)]
pub struct FreeBlockQueue {
    /// Per-block links, indexed by block id.
    links: Vec<Links>,
    /// The next block to evict.
    front: Option<BlockId>,
    /// The most recently freed block.
    back: Option<BlockId>,
    /// Number of blocks in the queue.
    len: usize,
}

impl FreeBlockQueue {
    /// A queue over `num_blocks` ids holding all of them, in id order.
    pub fn with_all_blocks(num_blocks: usize) -> Self {
        let mut queue = FreeBlockQueue {
            links: vec![Links::default(); num_blocks],
            front: None,
            back: None,
            len: 0,
        };
        for id in 0..num_blocks {
            queue.push_back(BlockId(id as u32));
        }
        queue
    }

    /// Number of blocks in the queue.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the queue holds no block.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `block` is in the queue.
    pub fn contains(&self, block: BlockId) -> bool {
        self.links[block.index()].in_queue
    }

    /// The block that `pop_front` would return.
    pub fn front(&self) -> Option<BlockId> {
        self.front
    }

    /// Appends `block` as the most recently freed. The block must not be in the queue.
    pub fn push_back(&mut self, block: BlockId) {
        debug_assert!(!self.contains(block), "block {} pushed twice", block.0);
        self.links[block.index()] = Links { prev: self.back, next: None, in_queue: true };
        match self.back {
            Some(old_back) => self.links[old_back.index()].next = Some(block),
            None => self.front = Some(block),
        }
        self.back = Some(block);
        self.len += 1;
    }

    /// Removes and returns the least recently freed block.
    pub fn pop_front(&mut self) -> Option<BlockId> {
        let block = self.front?;
        self.remove(block);
        Some(block)
    }

    /// Unlinks `block` from wherever it is. Returns whether it was in the queue.
    pub fn remove(&mut self, block: BlockId) -> bool {
        let Links { prev, next, in_queue } = self.links[block.index()];
        if !in_queue {
            return false;
        }
        match prev {
            Some(prev) => self.links[prev.index()].next = next,
            None => self.front = next,
        }
        match next {
            Some(next) => self.links[next.index()].prev = prev,
            None => self.back = prev,
        }
        self.links[block.index()] = Links::default();
        self.len -= 1;
        true
    }

    /// The blocks from front (next to evict) to back.
    pub fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        std::iter::successors(self.front, move |block| self.links[block.index()].next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(queue: &FreeBlockQueue) -> Vec<u32> {
        queue.iter().map(|b| b.0).collect()
    }

    #[test]
    fn starts_with_every_block_in_id_order() {
        let queue = FreeBlockQueue::with_all_blocks(4);
        assert_eq!(ids(&queue), vec![0, 1, 2, 3]);
        assert_eq!(queue.len(), 4);
    }

    #[test]
    fn pop_front_returns_least_recently_pushed() {
        let mut queue = FreeBlockQueue::with_all_blocks(3);
        assert_eq!(queue.pop_front(), Some(BlockId(0)));
        queue.push_back(BlockId(0));
        assert_eq!(ids(&queue), vec![1, 2, 0]);
    }

    #[test]
    fn remove_from_the_middle_keeps_the_rest_linked() {
        let mut queue = FreeBlockQueue::with_all_blocks(5);
        assert!(queue.remove(BlockId(2)));
        assert!(!queue.remove(BlockId(2)));
        assert_eq!(ids(&queue), vec![0, 1, 3, 4]);
        assert!(queue.remove(BlockId(0)));
        assert!(queue.remove(BlockId(4)));
        assert_eq!(ids(&queue), vec![1, 3]);
        assert_eq!(queue.front(), Some(BlockId(1)));
        assert_eq!(queue.len(), 2);
    }

    #[test]
    fn emptied_queue_pops_nothing_and_refills() {
        let mut queue = FreeBlockQueue::with_all_blocks(2);
        queue.pop_front();
        queue.pop_front();
        assert!(queue.is_empty());
        assert_eq!(queue.pop_front(), None);
        queue.push_back(BlockId(1));
        assert_eq!(ids(&queue), vec![1]);
    }
}
