//! Speculative decoding in the core: which tokens a decoding sequence proposes for the model
//! to verify, and the per-sequence indexes that find them without rescanning its tokens.
//!
//! A speculative decode step of a sequence whose known tokens end in `t` (its KV not yet
//! computed) schedules `t` and `k` proposed tokens `d1..dk` at the next positions:
//!
//! ```text
//!   inputs      [ t  d1  d2  d3 ]        positions p, p+1, p+2, p+3
//!   logits rows [ r0 r1  r2  r3 ]        r_i verifies d_{i+1}; r3 is the bonus row
//!   sampled     [ d1 d2  x   .  ]        d1, d2 accepted, x (≠ d3) corrects d3
//!   appended    d1 d2 x                  KV of t, d1, d2 kept; d3's slot is garbage
//! ```
//!
//! The verifier (Python) samples every row so that a row's token equals its proposal exactly
//! when the proposal is accepted (greedy: the argmax; sampling: rejection sampling). The core
//! then appends the longest prefix of matching rows plus one token, the first that differs
//! (or the bonus row's). Only verified tokens are ever cached; slots past the sequence's
//! known tokens are released after verification.
//!
//! Proposers:
//! - `Ngram` (prompt lookup, vLLM's `ngram`): the tokens that followed the latest earlier
//!   occurrence of the sequence's last `n` tokens, trying `n` from `max_n` down to `min_n`.
//! - `Suffix` (vLLM's `suffix`): a depth-limited suffix trie with counts over the sequence's
//!   own tokens, and a shared one over the outputs of recently finished sequences; the
//!   longest match of the current suffix is extended greedily by its most frequent
//!   continuation while that path's estimated probability stays above `min_token_prob`.
//! - `DraftModel` (`"draft_model"`): the core reserves the slots and placeholders; the
//!   caller runs the draft model, writes its proposals into the batch and hands them back
//!   with the sampled tokens.

use std::collections::{HashMap, VecDeque};

use crate::error::{Error, Result};
use crate::prefix_cache::BuildPrehashed;

/// How a sequence's proposals are found.
#[derive(Debug, Clone, PartialEq)]
pub enum SpeculativeMethod {
    /// Prompt lookup over the sequence's own tokens.
    Ngram {
        /// Shortest suffix matched.
        min_n: usize,
        /// Longest suffix matched (tried first).
        max_n: usize,
    },
    /// Suffix decoding over the sequence's tokens and recent outputs.
    Suffix {
        /// Deepest path indexed (the longest suffix matched plus what it proposes).
        max_depth: usize,
        /// A continuation is proposed while its estimated probability is at least this.
        min_token_prob: f64,
        /// At most `max_spec_factor * match length` tokens are proposed.
        max_spec_factor: f64,
        /// Finished sequences whose outputs the shared trie keeps.
        max_cached_requests: usize,
    },
    /// Proposals from a draft model the caller runs.
    DraftModel,
}

/// Speculative decoding settings of a scheduler.
#[derive(Debug, Clone, PartialEq)]
pub struct SpeculativeConfig {
    /// Where proposals come from.
    pub method: SpeculativeMethod,
    /// Most tokens proposed per sequence and step (`k`).
    pub num_speculative_tokens: usize,
    /// No sequence speculates in a step that starts with this many running sequences or
    /// more (the batch is then compute-bound and verification would cost more than it
    /// saves).
    pub disable_by_batch_size: Option<usize>,
}

impl SpeculativeConfig {
    /// Checks the settings; the scheduler refuses to start otherwise.
    pub(crate) fn validate(&self) -> Result<()> {
        let invalid = |message: String| Err(Error::InvalidArgument(message));
        if !(1..=MAX_SPECULATIVE_TOKENS).contains(&self.num_speculative_tokens) {
            return invalid(format!(
                "num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, got {}",
                self.num_speculative_tokens
            ));
        }
        if self.disable_by_batch_size == Some(0) {
            return invalid("disable_by_batch_size must be at least 1 (or unset)".into());
        }
        match self.method {
            SpeculativeMethod::Ngram { min_n, max_n } => {
                if min_n == 0 || min_n > max_n {
                    return invalid(format!(
                        "prompt_lookup_min ({min_n}) must be at least 1 and at most \
                         prompt_lookup_max ({max_n})"
                    ));
                }
            }
            SpeculativeMethod::Suffix {
                max_depth,
                min_token_prob,
                max_spec_factor,
                max_cached_requests: _,
            } => {
                if !(2..=255).contains(&max_depth) {
                    return invalid(format!(
                        "suffix_decoding_max_tree_depth must be between 2 and 255, got {max_depth}"
                    ));
                }
                if !(0.0..=1.0).contains(&min_token_prob) {
                    return invalid(format!(
                        "suffix_decoding_min_token_prob must be in [0, 1], got {min_token_prob}"
                    ));
                }
                if !(max_spec_factor > 0.0 && max_spec_factor.is_finite()) {
                    return invalid(format!(
                        "suffix_decoding_max_spec_factor must be positive, got {max_spec_factor}"
                    ));
                }
            }
            SpeculativeMethod::DraftModel => {}
        }
        Ok(())
    }
}

/// Most tokens a sequence may propose per step (`k`'s upper bound). Declared here only:
/// Python reads it as `pagedrs._core.MAX_SPECULATIVE_TOKENS`.
pub const MAX_SPECULATIVE_TOKENS: usize = 32;

/// A sequence's proposer state.
#[derive(Debug, Clone)]
pub(crate) enum Drafter {
    /// Prompt lookup index.
    Ngram(NgramIndex),
    /// The sequence's own suffix trie.
    Suffix(SuffixTrie),
    /// Placeholders the caller fills with its draft model's proposals.
    DraftModel,
}

impl Drafter {
    /// A fresh proposer for a sequence under `method`.
    pub(crate) fn new(method: &SpeculativeMethod) -> Self {
        match *method {
            SpeculativeMethod::Ngram { .. } => Drafter::Ngram(NgramIndex::default()),
            SpeculativeMethod::Suffix { max_depth, .. } => {
                Drafter::Suffix(SuffixTrie::new(max_depth, false))
            }
            SpeculativeMethod::DraftModel => Drafter::DraftModel,
        }
    }

    /// Writes up to `max_tokens` proposals to follow `token_ids` into `out` (cleared first).
    pub(crate) fn propose(
        &mut self,
        method: &SpeculativeMethod,
        token_ids: &[u32],
        max_tokens: usize,
        shared: Option<&SuffixTrie>,
        out: &mut Vec<u32>,
    ) {
        out.clear();
        if max_tokens == 0 {
            return;
        }
        match (self, method) {
            (Drafter::Ngram(index), &SpeculativeMethod::Ngram { min_n, max_n }) => {
                index.propose(token_ids, min_n, max_n, max_tokens, out);
            }
            (
                Drafter::Suffix(trie),
                &SpeculativeMethod::Suffix { min_token_prob, max_spec_factor, .. },
            ) => {
                trie.extend(token_ids);
                let rule = SuffixRule { max_tokens, min_token_prob, max_spec_factor };
                let own = trie.propose_from_active(rule);
                let cached = shared.map(|shared| shared.propose_for(token_ids, rule));
                // The longer proposal wins; on a tie, the sequence's own.
                let best = match cached {
                    Some(cached) if cached.len() > own.len() => cached,
                    _ => own,
                };
                out.extend_from_slice(&best);
            }
            (Drafter::DraftModel, _) => out.resize(max_tokens, 0),
            _ => unreachable!("a drafter is built for its scheduler's method"),
        }
    }
}

/// Splitmix-style mixing of an n-gram into a map key (collisions are checked against the
/// tokens themselves, so a collision only loses a proposal).
fn ngram_key(tokens: &[u32]) -> u64 {
    let mut key = tokens.len() as u64;
    for &token in tokens {
        key = (key ^ u64::from(token)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        key ^= key >> 29;
    }
    key
}

/// Prompt lookup: for every `n`-gram of a sequence (`min_n..=max_n`) the position just after
/// its latest occurrence whose next token is known. Updated as tokens are appended.
#[derive(Debug, Clone, Default)]
pub(crate) struct NgramIndex {
    /// Key of an n-gram to the position right after its latest indexed occurrence.
    ngram_to_next: HashMap<u64, u32, BuildPrehashed>,
    /// Occurrences followed by a position below this are indexed.
    num_indexed: usize,
}

impl NgramIndex {
    /// Indexes every n-gram whose following token is now known.
    fn extend(&mut self, token_ids: &[u32], min_n: usize, max_n: usize) {
        let last_follower = token_ids.len().saturating_sub(1);
        for next in self.num_indexed.max(min_n)..=last_follower {
            for n in min_n..=max_n.min(next) {
                self.ngram_to_next.insert(ngram_key(&token_ids[next - n..next]), next as u32);
            }
        }
        self.num_indexed = self.num_indexed.max(last_follower + 1);
    }

    fn propose(
        &mut self,
        token_ids: &[u32],
        min_n: usize,
        max_n: usize,
        max_tokens: usize,
        out: &mut Vec<u32>,
    ) {
        self.extend(token_ids, min_n, max_n);
        let len = token_ids.len();
        for n in (min_n..=max_n.min(len)).rev() {
            let suffix = &token_ids[len - n..];
            let Some(&next) = self.ngram_to_next.get(&ngram_key(suffix)) else {
                continue;
            };
            let next = next as usize;
            if next >= n && next < len && &token_ids[next - n..next] == suffix {
                out.extend_from_slice(&token_ids[next..(next + max_tokens).min(len)]);
                return;
            }
        }
    }
}

/// How far a suffix-trie proposal goes.
#[derive(Debug, Clone, Copy)]
struct SuffixRule {
    /// Most tokens proposed.
    max_tokens: usize,
    /// The path's estimated probability must stay at least this.
    min_token_prob: f64,
    /// At most this many tokens per token of the matched suffix.
    max_spec_factor: f64,
}

/// One node of a suffix trie: a path of tokens from the root.
#[derive(Debug, Clone, Copy, Default)]
struct TrieNode {
    /// Occurrences of the path in the indexed text.
    count: u32,
    /// Length of the path.
    depth: u8,
    /// The child with the largest count, as `(token, node)`.
    best_child: Option<(u32, u32)>,
    /// The node this one extends (the root's is itself).
    parent: u32,
    /// The token this one adds to its parent's path.
    token: u32,
}

/// A suffix trie cut at `max_depth`: every path of at most `max_depth` tokens that occurs in
/// the indexed text, with its number of occurrences. Appending a token extends the paths of
/// the text's current suffixes, `O(max_depth)` map operations a token.
#[derive(Debug, Clone)]
pub(crate) struct SuffixTrie {
    /// Deepest path kept.
    max_depth: usize,
    /// Node 0 is the root.
    nodes: Vec<TrieNode>,
    /// `(parent << 32 | token)` to the child node.
    edges: HashMap<u64, u32, BuildPrehashed>,
    /// Children of each node (kept only by a trie that removes text, to re-find the best
    /// child when counts fall).
    children: Option<Vec<Vec<(u32, u32)>>>,
    /// Nodes whose paths no longer occur, for reuse (a trie that removes text).
    free_nodes: Vec<u32>,
    /// Nodes of the text's current suffixes, shortest first (depth 1, 2, ...).
    active: Vec<u32>,
    /// Tokens of the sequence indexed so far (a per-sequence trie).
    num_indexed: usize,
}

fn edge_key(parent: u32, token: u32) -> u64 {
    (u64::from(parent) << 32) | u64::from(token)
}

impl SuffixTrie {
    pub(crate) fn new(max_depth: usize, removable: bool) -> Self {
        SuffixTrie {
            max_depth,
            nodes: vec![TrieNode::default()],
            edges: HashMap::default(),
            children: removable.then(|| vec![Vec::new()]),
            free_nodes: Vec::new(),
            active: Vec::with_capacity(max_depth),
            num_indexed: 0,
        }
    }

    /// Indexes the tokens of a sequence not indexed yet.
    fn extend(&mut self, token_ids: &[u32]) {
        for &token in &token_ids[self.num_indexed.min(token_ids.len())..] {
            self.push(token);
        }
        self.num_indexed = token_ids.len();
    }

    /// Appends one token to the indexed text.
    fn push(&mut self, token: u32) {
        // Extend the suffixes that can still grow, deepest last; the new suffixes are the
        // one-token path plus each extension.
        let mut next_active = Vec::with_capacity(self.max_depth);
        next_active.push(self.add_occurrence(0, token));
        for position in 0..self.active.len().min(self.max_depth - 1) {
            let parent = self.active[position];
            next_active.push(self.add_occurrence(parent, token));
        }
        self.active = next_active;
    }

    /// Counts one more occurrence of `parent`'s path followed by `token`; returns the child.
    fn add_occurrence(&mut self, parent: u32, token: u32) -> u32 {
        let key = edge_key(parent, token);
        let child = match self.edges.get(&key) {
            Some(&child) => child,
            None => {
                let depth = self.nodes[parent as usize].depth + 1;
                let node = TrieNode { count: 0, depth, best_child: None, parent, token };
                let child = match self.free_nodes.pop() {
                    Some(free) => {
                        self.nodes[free as usize] = node;
                        free
                    }
                    None => {
                        self.nodes.push(node);
                        if let Some(children) = &mut self.children {
                            children.push(Vec::new());
                        }
                        (self.nodes.len() - 1) as u32
                    }
                };
                self.edges.insert(key, child);
                if let Some(children) = &mut self.children {
                    children[parent as usize].push((token, child));
                }
                child
            }
        };
        self.nodes[child as usize].count += 1;
        let count = self.nodes[child as usize].count;
        let best = &mut self.nodes[parent as usize].best_child;
        let replaces = match *best {
            None => true,
            Some((_, best_node)) => {
                best_node != child && count > self.nodes[best_node as usize].count
            }
        };
        if replaces {
            self.nodes[parent as usize].best_child = Some((token, child));
        }
        child
    }

    /// Forgets one occurrence of each path of `text`'s suffixes (undoes `push` of `text` as
    /// a whole, for a trie built with `removable`).
    /// Nodes whose count falls to 0 are unlinked and reused, so the trie holds only paths
    /// of the text still indexed.
    fn remove_text(&mut self, text: &[u32]) {
        let mut emptied = Vec::new();
        for start in 0..text.len() {
            let mut parent = 0u32;
            for &token in &text[start..text.len().min(start + self.max_depth)] {
                let Some(&child) = self.edges.get(&edge_key(parent, token)) else {
                    break;
                };
                let node = &mut self.nodes[child as usize];
                node.count = node.count.saturating_sub(1);
                if node.count == 0 {
                    emptied.push(child);
                }
                if self.nodes[parent as usize].best_child.map(|(_, best)| best) == Some(child) {
                    self.refresh_best_child(parent);
                }
                parent = child;
            }
        }
        // NOTE: a path occurs no more often than its prefix, so an emptied node's children
        // are emptied too (now or before): unlinking after the walk frees whole subtrees.
        for node in emptied {
            let TrieNode { parent, token, .. } = self.nodes[node as usize];
            self.edges.remove(&edge_key(parent, token));
            if let Some(children) = &mut self.children {
                children[parent as usize].retain(|&(_, child)| child != node);
                children[node as usize].clear();
            }
            self.nodes[node as usize].best_child = None;
            self.free_nodes.push(node);
        }
    }

    /// Nodes holding a path that occurs (the root included).
    #[cfg(test)]
    fn num_live_nodes(&self) -> usize {
        self.nodes.len() - self.free_nodes.len()
    }

    fn refresh_best_child(&mut self, parent: u32) {
        let Some(children) = &self.children else {
            return;
        };
        let best = children[parent as usize]
            .iter()
            .filter(|&&(_, child)| self.nodes[child as usize].count > 0)
            .max_by_key(|&&(_, child)| self.nodes[child as usize].count)
            .copied();
        self.nodes[parent as usize].best_child = best;
    }

    /// The node of `suffix`'s path, if it occurs.
    fn find(&self, suffix: &[u32]) -> Option<u32> {
        let mut node = 0u32;
        for &token in suffix {
            node = *self.edges.get(&edge_key(node, token))?;
        }
        Some(node)
    }

    /// Follows the most frequent continuation from `node` (the match of a suffix).
    fn walk(&self, mut node: u32, rule: SuffixRule) -> Vec<u32> {
        let match_len = usize::from(self.nodes[node as usize].depth);
        let limit = rule.max_tokens.min((rule.max_spec_factor * match_len as f64).ceil() as usize);
        let mut tokens = Vec::with_capacity(limit);
        let mut probability = 1.0;
        while tokens.len() < limit {
            let Some((token, child)) = self.nodes[node as usize].best_child else {
                break;
            };
            let parent_count = f64::from(self.nodes[node as usize].count.max(1));
            probability *= f64::from(self.nodes[child as usize].count) / parent_count;
            if probability < rule.min_token_prob || self.nodes[child as usize].count == 0 {
                break;
            }
            tokens.push(token);
            node = child;
        }
        tokens
    }

    /// Proposal from the sequence's own trie: the deepest current suffix (leaving room to
    /// walk) that has a continuation.
    fn propose_from_active(&self, rule: SuffixRule) -> Vec<u32> {
        let room = self.max_depth.saturating_sub(rule.max_tokens).max(1);
        for &node in self.active[..self.active.len().min(room)].iter().rev() {
            if self.nodes[node as usize].best_child.is_some() {
                let tokens = self.walk(node, rule);
                if !tokens.is_empty() {
                    return tokens;
                }
            }
        }
        Vec::new()
    }

    /// Proposal from a shared trie for a sequence whose tokens are `token_ids`.
    fn propose_for(&self, token_ids: &[u32], rule: SuffixRule) -> Vec<u32> {
        let room = self.max_depth.saturating_sub(rule.max_tokens).max(1);
        for len in (1..=room.min(token_ids.len())).rev() {
            if let Some(node) = self.find(&token_ids[token_ids.len() - len..]) {
                let tokens = self.walk(node, rule);
                if !tokens.is_empty() {
                    return tokens;
                }
            }
        }
        Vec::new()
    }
}

/// The suffix trie shared by all sequences: the outputs of the last `max_cached_requests`
/// finished sequences.
#[derive(Debug, Clone)]
pub(crate) struct SuffixCache {
    /// Outputs indexed.
    pub(crate) trie: SuffixTrie,
    /// Those outputs, oldest first, to forget them in order.
    outputs: VecDeque<Vec<u32>>,
    /// Most outputs kept.
    max_cached_requests: usize,
}

impl SuffixCache {
    pub(crate) fn new(max_depth: usize, max_cached_requests: usize) -> Self {
        SuffixCache {
            trie: SuffixTrie::new(max_depth, true),
            outputs: VecDeque::new(),
            max_cached_requests,
        }
    }

    /// Indexes a finished sequence's output, forgetting the oldest beyond the limit.
    pub(crate) fn insert(&mut self, output: &[u32]) {
        if self.max_cached_requests == 0 || output.is_empty() {
            return;
        }
        if self.outputs.len() == self.max_cached_requests {
            let oldest = self.outputs.pop_front().expect("the cache is full");
            self.trie.remove_text(&oldest);
        }
        self.trie.active.clear();
        for &token in output {
            self.trie.push(token);
        }
        self.trie.active.clear();
        self.outputs.push_back(output.to_vec());
    }

    /// Outputs kept.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.outputs.len()
    }
}

#[cfg(test)]
#[path = "speculative_tests.rs"]
mod tests;
