//! `BlockId`, the index of a physical KV block: its own module because the pool, its free
//! queue and the error type all name it, and none of them should import another for it.

/// Index of a physical block in the KV cache tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl BlockId {
    /// Not a block: a block-table entry whose block was released (it fell out of its layer
    /// group's window). Pools are never this large.
    pub const NULL: BlockId = BlockId(u32::MAX);

    /// The id as a `usize` index.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
