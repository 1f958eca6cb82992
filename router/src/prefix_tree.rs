//! An approximate radix tree of the routing keys sent to one worker.
//!
//! The router cannot see a worker's KV cache, so it remembers what it sent there: every key
//! routed to a worker is inserted into that worker's tree, and the longest match of a new
//! key says how much of its prompt the worker has probably cached. "Approximate" because the
//! worker evicts on its own schedule; the tree is a guess, kept to a size cap by evicting
//! least-recently-used leaves.
//!
//! Keys are sequences of `char`s, not bytes: a split never falls inside a multibyte UTF-8
//! character, and lengths (`num_chars`, matches, the cap) count characters.
//!
//! ```text
//!   insert "hello world", then "help me":
//!
//!   root ── "hel" ─┬─ "lo world"     an edge is split where two keys diverge;
//!                  └─ "p me"         siblings differ in their first char
//! ```
//!
//! Invariants (checked after every step by the tests):
//! - `num_chars` is the sum of the label lengths, and `num_chars <= max_chars` after `insert`;
//! - `leaves_by_access` holds exactly the non-root nodes without children;
//! - a node was accessed no earlier than any of its children (an insert touches a whole path),
//!   so evicting the least recently used leaf never strands a fresher descendant.

use std::collections::{BTreeSet, HashMap};

/// A node's index in the tree's arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct NodeId(usize);

/// The root: always present, with an empty label.
const ROOT: NodeId = NodeId(0);

/// One node: the edge that leads to it from its parent, and its children.
#[derive(Debug, Default)]
struct Node {
    /// The text on the edge from the parent; empty only for the root and for free slots.
    label: String,
    /// Number of chars (not bytes) in `label`.
    num_label_chars: usize,
    /// The parent; `None` for the root and for free slots.
    parent: Option<NodeId>,
    /// Children keyed by the first char of their label.
    first_char_to_child: HashMap<char, NodeId>,
    /// Logical time of the last insert that passed through this node.
    last_access: u64,
}

/// A radix tree over chars with a cap on the chars it holds (see the module docs).
#[derive(Debug)]
pub struct PrefixTree {
    /// The arena; `nodes[0]` is the root. Free slots are listed in `free_node_ids`.
    nodes: Vec<Node>,
    /// Slots of evicted nodes, reused before the arena grows.
    free_node_ids: Vec<NodeId>,
    /// Every leaf (non-root node without children), ordered least recently used first.
    leaves_by_access: BTreeSet<(u64, NodeId)>,
    /// Chars held: the sum of all labels' lengths.
    num_chars: usize,
    /// The cap on `num_chars`; an insert that passes it evicts leaves until it holds again.
    max_chars: usize,
    /// The logical clock, advanced by each insert.
    clock: u64,
}

impl PrefixTree {
    /// An empty tree that will hold at most `max_chars` chars.
    pub fn new(max_chars: usize) -> Self {
        PrefixTree {
            nodes: vec![Node::default()],
            free_node_ids: Vec::new(),
            leaves_by_access: BTreeSet::new(),
            num_chars: 0,
            max_chars,
            clock: 0,
        }
    }

    /// Chars held (at most `max_chars`).
    pub fn num_chars(&self) -> usize {
        self.num_chars
    }

    /// Forgets every key (the worker behind it lost its cache, or left).
    pub fn clear(&mut self) {
        *self = PrefixTree::new(self.max_chars);
    }

    /// Length in chars of the longest prefix of `key` that the tree holds.
    pub fn longest_prefix_chars(&self, key: &[char]) -> usize {
        let mut node_id = ROOT;
        let mut num_matched = 0;
        while let Some(first_char) = key.get(num_matched) {
            let Some(&child_id) = self.node(node_id).first_char_to_child.get(first_char) else {
                break;
            };
            let child = self.node(child_id);
            let (num_common_chars, _) = common_prefix(&child.label, &key[num_matched..]);
            num_matched += num_common_chars;
            if num_common_chars < child.num_label_chars {
                break;
            }
            node_id = child_id;
        }
        num_matched
    }

    /// Inserts `key` as the most recently used, then evicts least-recently-used leaves while
    /// the tree holds more than `max_chars` chars. Of a key longer than the cap, only the
    /// first `max_chars` chars are kept (the prefix is what a cache reuses).
    pub fn insert(&mut self, key: &[char]) {
        let key = &key[..key.len().min(self.max_chars)];
        if key.is_empty() {
            return;
        }
        self.clock += 1;
        let now = self.clock;
        let mut node_id = ROOT;
        let mut num_matched = 0;
        while let Some(first_char) = key.get(num_matched) {
            let rest = &key[num_matched..];
            let Some(&child_id) = self.node(node_id).first_char_to_child.get(first_char) else {
                self.add_leaf(node_id, rest, now);
                break;
            };
            let (num_common_chars, num_common_bytes) =
                common_prefix(&self.node(child_id).label, rest);
            let on_path_id = if num_common_chars < self.node(child_id).num_label_chars {
                self.split(child_id, num_common_chars, num_common_bytes)
            } else {
                child_id
            };
            self.touch(on_path_id, now);
            num_matched += num_common_chars;
            node_id = on_path_id;
        }
        self.evict_least_recently_used();
    }

    /// The node in slot `id`.
    fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.0]
    }

    /// The node in slot `id`, to change.
    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.nodes[id.0]
    }

    /// Whether `id` is a leaf: not the root, and without children.
    fn is_leaf(&self, id: NodeId) -> bool {
        id != ROOT && self.node(id).first_char_to_child.is_empty()
    }

    /// Stores `node` in a free slot (or a new one) and returns its id.
    fn allocate(&mut self, node: Node) -> NodeId {
        match self.free_node_ids.pop() {
            Some(id) => {
                *self.node_mut(id) = node;
                id
            }
            None => {
                self.nodes.push(node);
                NodeId(self.nodes.len() - 1)
            }
        }
    }

    /// Marks `id` as used at `now`, keeping its place in `leaves_by_access` in step.
    fn touch(&mut self, id: NodeId, now: u64) {
        let old_access = self.node(id).last_access;
        if self.is_leaf(id) {
            self.leaves_by_access.remove(&(old_access, id));
            self.leaves_by_access.insert((now, id));
        }
        self.node_mut(id).last_access = now;
    }

    /// Adds a leaf labelled `text` under `parent_id`, whose children do not start with
    /// `text[0]`.
    fn add_leaf(&mut self, parent_id: NodeId, text: &[char], now: u64) {
        if self.is_leaf(parent_id) {
            let parent_access = self.node(parent_id).last_access;
            self.leaves_by_access.remove(&(parent_access, parent_id));
        }
        let leaf_id = self.allocate(Node {
            label: text.iter().collect(),
            num_label_chars: text.len(),
            parent: Some(parent_id),
            first_char_to_child: HashMap::new(),
            last_access: now,
        });
        self.node_mut(parent_id).first_char_to_child.insert(text[0], leaf_id);
        self.leaves_by_access.insert((now, leaf_id));
        self.num_chars += text.len();
    }

    /// Splits the edge into `child_id` after its first `num_chars` chars (`num_bytes` bytes)
    /// and returns the new node at the split point, which takes `child_id`'s place.
    ///
    /// ```text
    ///   parent ── "hello" ── child   →   parent ── "hel" ── upper ── "lo" ── child
    /// ```
    fn split(&mut self, child_id: NodeId, num_chars: usize, num_bytes: usize) -> NodeId {
        let child = self.node_mut(child_id);
        let tail = child.label.split_off(num_bytes);
        let head = std::mem::replace(&mut child.label, tail);
        let first_char = head.chars().next().expect("a split keeps at least one char above");
        let tail_first_char = child.label.chars().next().expect("a split keeps one char below");
        let parent_id = child.parent.expect("only the root has no parent");
        let child_access = child.last_access;
        child.num_label_chars -= num_chars;
        let upper_id = self.allocate(Node {
            label: head,
            num_label_chars: num_chars,
            parent: Some(parent_id),
            first_char_to_child: HashMap::from([(tail_first_char, child_id)]),
            last_access: child_access,
        });
        self.node_mut(child_id).parent = Some(upper_id);
        self.node_mut(parent_id).first_char_to_child.insert(first_char, upper_id);
        upper_id
    }

    /// Evicts least-recently-used leaves until the tree holds at most `max_chars` chars. A
    /// parent left without children becomes a leaf and may go next.
    fn evict_least_recently_used(&mut self) {
        while self.num_chars > self.max_chars {
            let Some((_, leaf_id)) = self.leaves_by_access.pop_first() else {
                break;
            };
            let leaf = std::mem::take(self.node_mut(leaf_id));
            self.free_node_ids.push(leaf_id);
            self.num_chars -= leaf.num_label_chars;
            let parent_id = leaf.parent.expect("a leaf is never the root");
            let first_char = leaf.label.chars().next().expect("a leaf's label is never empty");
            self.node_mut(parent_id).first_char_to_child.remove(&first_char);
            if self.is_leaf(parent_id) {
                let parent_access = self.node(parent_id).last_access;
                self.leaves_by_access.insert((parent_access, parent_id));
            }
        }
    }

    /// Panics unless every invariant in the module docs holds (tests only).
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        let mut num_reachable = 0;
        let mut num_chars = 0;
        let mut leaves = BTreeSet::new();
        let mut to_visit = vec![ROOT];
        while let Some(id) = to_visit.pop() {
            num_reachable += 1;
            let node = self.node(id);
            assert_eq!(node.num_label_chars, node.label.chars().count(), "node {id:?}");
            assert_eq!(id == ROOT, node.label.is_empty(), "only the root has an empty label");
            num_chars += node.num_label_chars;
            if self.is_leaf(id) {
                leaves.insert((node.last_access, id));
            }
            for (&first_char, &child_id) in &node.first_char_to_child {
                let child = self.node(child_id);
                assert_eq!(child.parent, Some(id), "child {child_id:?} of {id:?}");
                assert_eq!(child.label.chars().next(), Some(first_char));
                assert!(child.last_access <= node.last_access || id == ROOT);
                to_visit.push(child_id);
            }
        }
        assert_eq!(num_reachable + self.free_node_ids.len(), self.nodes.len(), "leaked slots");
        assert_eq!(num_chars, self.num_chars);
        assert!(self.num_chars <= self.max_chars, "{} > cap {}", self.num_chars, self.max_chars);
        assert_eq!(leaves, self.leaves_by_access);
    }
}

/// Chars and bytes of the longest common prefix of `label` and `key`.
fn common_prefix(label: &str, key: &[char]) -> (usize, usize) {
    let mut num_chars = 0;
    let mut num_bytes = 0;
    for (label_char, key_char) in label.chars().zip(key) {
        if label_char != *key_char {
            break;
        }
        num_chars += 1;
        num_bytes += label_char.len_utf8();
    }
    (num_chars, num_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    /// `text` as the char sequence the tree takes.
    fn chars(text: &str) -> Vec<char> {
        text.chars().collect()
    }

    /// A tree with room for everything the tests put in it.
    fn unbounded_tree() -> PrefixTree {
        PrefixTree::new(usize::MAX)
    }

    #[test]
    fn empty_tree_matches_nothing() {
        let tree = unbounded_tree();
        assert_eq!(tree.longest_prefix_chars(&chars("hello")), 0);
        assert_eq!(tree.num_chars(), 0);
        tree.check_invariants();
    }

    #[test]
    fn inserted_key_matches_in_full_and_through_its_prefixes() {
        let mut tree = unbounded_tree();
        tree.insert(&chars("hello world"));
        assert_eq!(tree.longest_prefix_chars(&chars("hello world")), 11);
        assert_eq!(tree.longest_prefix_chars(&chars("hello world, again")), 11);
        assert_eq!(tree.longest_prefix_chars(&chars("hello")), 5);
        assert_eq!(tree.longest_prefix_chars(&chars("help")), 3);
        assert_eq!(tree.longest_prefix_chars(&chars("world")), 0);
        assert_eq!(tree.num_chars(), 11);
        tree.check_invariants();
    }

    #[test]
    fn diverging_keys_split_the_edge_and_both_still_match() {
        let mut tree = unbounded_tree();
        tree.insert(&chars("hello world"));
        tree.insert(&chars("help me"));
        tree.check_invariants();
        assert_eq!(tree.longest_prefix_chars(&chars("hello world")), 11);
        assert_eq!(tree.longest_prefix_chars(&chars("help me")), 7);
        assert_eq!(tree.longest_prefix_chars(&chars("helium")), 3);
        // "hel" is shared: 3 + "lo world" (8) + "p me" (4).
        assert_eq!(tree.num_chars(), 15);
    }

    #[test]
    fn a_key_ending_inside_an_edge_splits_it_and_adds_no_chars() {
        let mut tree = unbounded_tree();
        tree.insert(&chars("abcdef"));
        tree.insert(&chars("abc"));
        tree.check_invariants();
        assert_eq!(tree.num_chars(), 6);
        assert_eq!(tree.longest_prefix_chars(&chars("abcxyz")), 3);
        assert_eq!(tree.longest_prefix_chars(&chars("abcdef")), 6);
    }

    #[test]
    fn reinserting_a_key_adds_no_chars() {
        let mut tree = unbounded_tree();
        tree.insert(&chars("same prompt"));
        tree.insert(&chars("same prompt"));
        assert_eq!(tree.num_chars(), 11);
        tree.check_invariants();
    }

    #[test]
    fn multibyte_text_splits_between_chars_never_inside_one() {
        let mut tree = unbounded_tree();
        tree.insert(&chars("日本語のテキスト"));
        tree.insert(&chars("日本人"));
        tree.insert(&chars("👍🏽 thumbs"));
        tree.insert(&chars("👍 thumbs"));
        tree.insert(&chars("cafe\u{301} noir"));
        tree.insert(&chars("café au lait"));
        tree.check_invariants();
        assert_eq!(tree.longest_prefix_chars(&chars("日本語")), 3);
        assert_eq!(tree.longest_prefix_chars(&chars("日本酒")), 2);
        assert_eq!(tree.longest_prefix_chars(&chars("日本人です")), 3);
        // The emoji and its skin-tone modifier are two chars; the keys share the first.
        assert_eq!(tree.longest_prefix_chars(&chars("👍🏽 thumbs")), 9);
        assert_eq!(tree.longest_prefix_chars(&chars("👍🏿")), 1);
        // "e" + combining accent and the precomposed "é" share only "caf".
        assert_eq!(tree.longest_prefix_chars(&chars("café")), 4);
        assert_eq!(tree.longest_prefix_chars(&chars("cafe\u{301}")), 5);
        assert_eq!(tree.longest_prefix_chars(&chars("cafX")), 3);
    }

    #[test]
    fn eviction_drops_least_recently_used_keys_and_keeps_total_under_cap() {
        let mut tree = PrefixTree::new(20);
        tree.insert(&chars("aaaaaaaaaa")); // 10 chars, oldest
        tree.insert(&chars("bbbbbbbbbb")); // 20 chars: at the cap
        tree.insert(&chars("aaaaaaaaaa")); // touched: "b…" is now the oldest
        tree.insert(&chars("cccccccccc")); // 30 > 20: evicts "b…"
        tree.check_invariants();
        assert_eq!(tree.num_chars(), 20);
        assert_eq!(tree.longest_prefix_chars(&chars("aaaaaaaaaa")), 10);
        assert_eq!(tree.longest_prefix_chars(&chars("bbbbbbbbbb")), 0);
        assert_eq!(tree.longest_prefix_chars(&chars("cccccccccc")), 10);
    }

    #[test]
    fn eviction_removes_a_stale_branch_before_the_shared_prefix() {
        let mut tree = PrefixTree::new(16);
        tree.insert(&chars("prefix-old")); // "prefix-" (7) + "old" (3)
        tree.insert(&chars("prefix-new")); // + "new" (3) = 13
        tree.insert(&chars("zzzz")); // 17 > 16: the leaf "old" goes first
        tree.check_invariants();
        assert_eq!(tree.num_chars(), 14);
        assert_eq!(tree.longest_prefix_chars(&chars("prefix-old")), 7);
        assert_eq!(tree.longest_prefix_chars(&chars("prefix-new")), 10);
    }

    #[test]
    fn a_key_longer_than_the_cap_keeps_only_its_first_max_chars() {
        let mut tree = PrefixTree::new(5);
        tree.insert(&chars("abc"));
        tree.insert(&chars("0123456789"));
        tree.check_invariants();
        assert_eq!(tree.num_chars(), 5);
        assert_eq!(tree.longest_prefix_chars(&chars("0123456789")), 5);
        assert_eq!(tree.longest_prefix_chars(&chars("abc")), 0);
    }

    #[test]
    fn clear_forgets_every_key() {
        let mut tree = unbounded_tree();
        tree.insert(&chars("hello"));
        tree.clear();
        tree.check_invariants();
        assert_eq!(tree.num_chars(), 0);
        assert_eq!(tree.longest_prefix_chars(&chars("hello")), 0);
    }

    /// A random key over a four-char alphabet with multibyte chars, so keys share prefixes
    /// often and splits land next to multibyte chars.
    fn random_key(rng: &mut SmallRng, max_len: usize) -> Vec<char> {
        const ALPHABET: [char; 4] = ['a', 'é', '日', '👍'];
        let len = rng.gen_range(0..=max_len);
        (0..len).map(|_| ALPHABET[rng.gen_range(0..ALPHABET.len())]).collect()
    }

    /// Chars shared at the start of `a` and `b`.
    fn shared_prefix_len(a: &[char], b: &[char]) -> usize {
        a.iter().zip(b).take_while(|(x, y)| x == y).count()
    }

    #[test]
    fn random_inserts_without_a_cap_match_like_a_list_of_every_key() {
        let mut rng = SmallRng::seed_from_u64(7);
        let mut tree = unbounded_tree();
        let mut inserted: Vec<Vec<char>> = Vec::new();
        for _ in 0..3_000 {
            let key = random_key(&mut rng, 10);
            if rng.gen_bool(0.5) {
                tree.insert(&key);
                inserted.push(key);
                tree.check_invariants();
            } else {
                let expected =
                    inserted.iter().map(|other| shared_prefix_len(&key, other)).max().unwrap_or(0);
                assert_eq!(tree.longest_prefix_chars(&key), expected, "key {key:?}");
            }
        }
    }

    #[test]
    fn random_inserts_under_a_cap_keep_every_invariant() {
        let mut rng = SmallRng::seed_from_u64(11);
        let mut tree = PrefixTree::new(40);
        for step in 0..100_000 {
            let key = random_key(&mut rng, 16);
            tree.insert(&key);
            if step % 7 == 0 {
                tree.check_invariants();
            }
            // Keys are shorter than the cap, so the newest one always survives its insert.
            assert_eq!(tree.longest_prefix_chars(&key), key.len(), "step {step}");
            if rng.gen_ratio(1, 5_000) {
                tree.clear();
            }
        }
        tree.check_invariants();
    }
}
