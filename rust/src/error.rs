//! The one error type of the crate. Running out of blocks is *not* an error (it is an
//! `Option`/`None` outcome); these are misuse and bad input, mapped by the binding
//! (`python/`) onto declared Python exception classes.

use std::fmt;

use crate::block_id::BlockId;

/// Everything that can go wrong when the core is misused or given bad input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A constructor or call argument is out of range (block_size 0, num_blocks 0, ...).
    InvalidArgument(String),
    /// No request with this id is known (never added, or already freed).
    UnknownRequest(String),
    /// A request with this id is already registered.
    DuplicateRequest(String),
    /// A block's reference count would go below zero: a double free inside the core.
    RefCountUnderflow(BlockId),
    /// A prefix hit found by `get_computed_blocks` was evicted before `allocate_slots`
    /// claimed it (some other allocation ran in between).
    StalePrefixHit(String),
    /// `check_invariants` found the block pool or the scheduler inconsistent (a bug in the
    /// core).
    InvariantViolation(String),
    /// No compiled grammar has this id (never compiled, or evicted from the grammar cache).
    UnknownGrammar(u64),
    /// No live grammar matcher has this handle (never added, or already removed).
    UnknownMatcher(u64),
}

/// Shorthand used across the crate.
pub type Result<T> = std::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidArgument(msg) => write!(f, "{msg}"),
            Error::UnknownRequest(id) => {
                write!(f, "unknown request id {id:?} (never added, or already freed)")
            }
            Error::DuplicateRequest(id) => write!(f, "request id {id:?} is already registered"),
            Error::RefCountUnderflow(block) => {
                write!(f, "block {} freed more times than it was allocated", block.0)
            }
            Error::InvariantViolation(what) => write!(f, "core invariant violated: {what}"),
            Error::UnknownGrammar(id) => write!(
                f,
                "unknown grammar id {id} (never compiled, or evicted from the grammar cache: \
                 compile it again)"
            ),
            Error::UnknownMatcher(handle) => {
                write!(f, "unknown matcher handle {handle} (never added, or already removed)")
            }
            Error::StalePrefixHit(id) => write!(
                f,
                "the prefix hit of request {id:?} was evicted before allocate_slots; \
                 call get_computed_blocks again right before allocating"
            ),
        }
    }
}

impl std::error::Error for Error {}
