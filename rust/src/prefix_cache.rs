//! Block hashes for prefix caching.
//!
//! A full block's key chains its parent's key and its own token ids. The chain starts at a
//! *root* key made of the model/namespace id (fixed per pool) and the request's
//! `cache_salt`, so the salt applied to the first block is carried by every block after it.
//!
//! ```text
//!   root = H(namespace, salt)
//!   block 0: h0 = H(root, tokens[0..bs])
//!   block 1: h1 = H(h0,   tokens[bs..2bs])      ... and so on; partial blocks get no key
//! ```
//!
//! The 128-bit key only *finds* a candidate. `BlockPool::lookup` then confirms the hit by
//! comparing the stored token ids, the parent block and the salt, so even a forced
//! collision can never hand one request another request's KV.

use std::hash::{BuildHasherDefault, Hasher};

use xxhash_rust::xxh3::xxh3_128;

/// A 128-bit block key (xxh3-128).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

/// Computes root and block keys; holds the namespace and the test-only collision mask.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    /// Key of the namespace alone (requests without a salt start their chain here).
    namespace_root: BlockHash,
    /// Bits of each key that are kept. All ones in production; tests narrow it to force
    /// collisions and check that the token comparison rejects them.
    keep_bits: u128,
    /// Reused buffer for `parent key ++ token bytes`, so hashing never allocates.
    scratch: Vec<u8>,
}

impl BlockHasher {
    /// A hasher whose chains all start from `namespace` (e.g. the model's identity).
    pub fn new(namespace: &str) -> Self {
        let mut bytes = Vec::with_capacity(namespace.len() + 16);
        bytes.extend_from_slice(b"pagedrs/namespace\0");
        bytes.extend_from_slice(namespace.as_bytes());
        BlockHasher {
            namespace_root: BlockHash(xxh3_128(&bytes)),
            keep_bits: u128::MAX,
            scratch: Vec::new(),
        }
    }

    /// The key a request's chain starts from.
    pub fn root(&self, cache_salt: Option<&str>) -> BlockHash {
        match cache_salt {
            None => self.namespace_root,
            Some(salt) => {
                let mut bytes = Vec::with_capacity(16 + 6 + salt.len());
                bytes.extend_from_slice(&self.namespace_root.0.to_le_bytes());
                bytes.extend_from_slice(b"salt\0");
                bytes.extend_from_slice(salt.as_bytes());
                BlockHash(xxh3_128(&bytes) & self.keep_bits)
            }
        }
    }

    /// The key of a full block whose parent key is `parent` and whose tokens are `token_ids`.
    pub fn block(&mut self, parent: BlockHash, token_ids: &[u32]) -> BlockHash {
        self.scratch.clear();
        self.scratch.extend_from_slice(&parent.0.to_ne_bytes());
        self.scratch.extend_from_slice(token_bytes(token_ids));
        BlockHash(xxh3_128(&self.scratch) & self.keep_bits)
    }

    /// Test hook: keep only the low `bits` bits of every key from now on, so distinct
    /// blocks collide (with `bits == 0`, every block has the same key).
    pub fn force_collisions_for_testing(&mut self, bits: u32) {
        self.keep_bits = if bits >= 128 { u128::MAX } else { (1u128 << bits) - 1 };
        self.namespace_root = BlockHash(self.namespace_root.0 & self.keep_bits);
    }
}

/// The tokens' bytes in native order, without copying. Keys never leave the process, so
/// native byte order is as good as a fixed one, and one `memcpy` beats a per-token loop.
fn token_bytes(token_ids: &[u32]) -> &[u8] {
    // SAFETY: u8 has alignment 1 and every bit pattern is a valid u8; the length covers
    // exactly the slice's initialized memory.
    unsafe {
        std::slice::from_raw_parts(
            token_ids.as_ptr().cast::<u8>(),
            std::mem::size_of_val(token_ids),
        )
    }
}

/// A `Hasher` for keys that are already uniformly distributed (xxh3 output, sequential
/// request handles): it folds the key instead of hashing it again.
#[derive(Debug, Default, Clone, Copy)]
pub struct PrehashedHasher(u64);

impl Hasher for PrehashedHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only reached for key types without a fixed-width write; fold bytes in.
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = (self.0.rotate_left(5) ^ u64::from_le_bytes(word))
                .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, value: u64) {
        // Multiply so sequential ids spread over the table's high bits too.
        self.0 = (self.0 ^ value).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn write_u128(&mut self, value: u128) {
        self.0 ^= (value as u64) ^ ((value >> 64) as u64);
    }
}

/// `BuildHasher` for maps keyed by block hashes or request handles.
pub type BuildPrehashed = BuildHasherDefault<PrehashedHasher>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_tokens_and_parent_give_the_same_key() {
        let mut hasher = BlockHasher::new("model-a");
        let root = hasher.root(None);
        assert_eq!(hasher.block(root, &[1, 2, 3, 4]), hasher.block(root, &[1, 2, 3, 4]));
    }

    #[test]
    fn salt_namespace_parent_and_tokens_each_change_the_key() {
        let mut hasher = BlockHasher::new("model-a");
        let plain = hasher.root(None);
        let salted = hasher.root(Some("tenant-1"));
        assert_ne!(plain, salted);
        assert_ne!(salted, hasher.root(Some("tenant-2")));
        assert_ne!(plain, BlockHasher::new("model-b").root(None));
        let block = hasher.block(plain, &[1, 2, 3, 4]);
        assert_ne!(block, hasher.block(salted, &[1, 2, 3, 4]));
        assert_ne!(block, hasher.block(plain, &[1, 2, 3, 5]));
    }

    #[test]
    fn forced_collisions_make_every_key_equal() {
        let mut hasher = BlockHasher::new("model-a");
        hasher.force_collisions_for_testing(0);
        let root = hasher.root(None);
        assert_eq!(hasher.block(root, &[1, 2]), hasher.block(root, &[3, 4]));
        assert_eq!(hasher.root(Some("x")), root);
    }
}
