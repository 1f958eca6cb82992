use std::cell::RefCell;
use std::collections::HashMap;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;

const BS: usize = 4;

fn manager(num_blocks: usize) -> KVCacheManager {
    KVCacheManager::new(num_blocks, BS, true, "test-model").unwrap()
}

fn ids(blocks: &[BlockId]) -> Vec<u32> {
    blocks.iter().map(|b| b.0).collect()
}

thread_local! {
    /// Tests name their sequences by small numbers; this maps them to the manager's handles
    /// (each test runs on its own thread).
    static NAMES: RefCell<HashMap<u64, SequenceId>> = RefCell::new(HashMap::new());
}

/// The handle of the sequence a test calls `name`.
fn id(name: u64) -> SequenceId {
    NAMES.with(|names| names.borrow()[&name])
}

/// Adds a sequence under a test name.
fn add(m: &mut KVCacheManager, name: u64, prompt: &[u32], salt: Option<&str>) {
    let handle = m.add_sequence(prompt, salt).unwrap();
    NAMES.with(|names| names.borrow_mut().insert(name, handle));
}

/// Forks `parent` into a sequence the test calls `child`.
fn fork(m: &mut KVCacheManager, parent: u64, child: u64) {
    let handle = m.fork(id(parent)).unwrap();
    NAMES.with(|names| names.borrow_mut().insert(child, handle));
}

/// Adds a sequence, looks up its prefix and allocates its whole prompt. Returns the hit.
fn admit(m: &mut KVCacheManager, name: u64, prompt: &[u32], salt: Option<&str>) -> usize {
    add(m, name, prompt, salt);
    let hit = m.get_computed_blocks(id(name)).unwrap();
    m.allocate_slots(id(name), prompt.len() - hit).unwrap().expect("enough blocks");
    m.pool().check_invariants().unwrap();
    hit
}

#[test]
fn block_counts_and_slack_match_the_worked_examples() {
    let mut m = KVCacheManager::new(64, 16, false, "").unwrap();
    for (n, (len, blocks, unused)) in
        [(35, 3, 13), (17, 2, 15), (64, 4, 0), (33, 3, 15)].into_iter().enumerate()
    {
        admit(&mut m, n as u64, &vec![1; len], None);
        let table = m.block_table(id(n as u64)).unwrap();
        assert_eq!(table.len(), blocks);
        assert_eq!(table.len() * 16 - len, unused);
    }
}

#[test]
fn identical_prefixes_share_blocks_without_new_allocation() {
    let mut m = manager(16);
    let prompt: Vec<u32> = (0..10).collect();
    assert_eq!(admit(&mut m, 1, &prompt, None), 0);
    let used_before = m.stats().num_used_blocks;
    assert_eq!(admit(&mut m, 2, &prompt, None), 8);
    let (a, b) = (m.block_table(id(1)).unwrap(), m.block_table(id(2)).unwrap());
    assert_eq!(a[..2], b[..2]);
    assert_ne!(a[2], b[2], "the partial last block is never shared");
    assert_eq!(m.pool().ref_count(a[0]), 2);
    assert_eq!(m.stats().num_used_blocks, used_before + 1);
    assert_eq!(m.stats().prefix_cache_hits, 8);
    assert_eq!(m.stats().prefix_cache_queries, 20);
}

#[test]
fn hit_never_covers_the_last_prompt_token() {
    let mut m = manager(16);
    let prompt: Vec<u32> = (0..8).collect();
    admit(&mut m, 1, &prompt, None);
    // Both blocks are cached, but the second holds the last token: only one is reused.
    assert_eq!(admit(&mut m, 2, &prompt, None), 4);
    assert_eq!(m.num_computed_tokens(id(2)).unwrap(), 8);
}

#[test]
fn different_cache_salt_never_shares() {
    let mut m = manager(32);
    let prompt: Vec<u32> = (0..13).collect();
    admit(&mut m, 1, &prompt, Some("alice"));
    assert_eq!(admit(&mut m, 2, &prompt, Some("bob")), 0);
    assert_eq!(admit(&mut m, 3, &prompt, None), 0);
    assert_eq!(admit(&mut m, 4, &prompt, Some("alice")), 12);
}

#[test]
fn one_token_difference_in_block_k_shares_only_blocks_before_k() {
    let mut m = manager(32);
    let prompt: Vec<u32> = (0..17).collect();
    admit(&mut m, 1, &prompt, None);
    for k in 0..4 {
        let mut other = prompt.clone();
        other[k * BS + 2] = 999;
        assert_eq!(admit(&mut m, 10 + k as u64, &other, None), k * BS, "difference in block {k}");
        let shared = m.block_table(id(10 + k as u64)).unwrap();
        assert_eq!(shared[..k], m.block_table(id(1)).unwrap()[..k]);
    }
}

#[test]
fn forced_hash_collision_is_rejected_by_the_token_check() {
    let mut m = manager(32);
    m.force_hash_collisions_for_testing(0);
    let first: Vec<u32> = (0..9).collect();
    admit(&mut m, 1, &first, None);
    // Every block of every sequence now has the same key. Only exact matches may hit.
    let mut second = first.clone();
    second[0] = 77;
    assert_eq!(admit(&mut m, 2, &second, None), 0);
    assert_eq!(admit(&mut m, 3, &first, Some("salted")), 0);
    assert_eq!(admit(&mut m, 4, &first, None), 4, "the one cached key still hits exactly");
    // Same tokens in block 1 but a different block 0: block 1 must not be reused.
    let mut shifted = first.clone();
    shifted[1] = 55;
    assert_eq!(admit(&mut m, 5, &shifted, None), 0);
}

#[test]
fn narrow_keys_collide_often_but_never_hand_out_wrong_blocks() {
    let mut m = manager(64);
    m.force_hash_collisions_for_testing(3);
    let mut rng = SmallRng::seed_from_u64(7);
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    for sequence in 0..200u64 {
        let prompt: Vec<u32> = (0..rng.gen_range(1..20)).map(|_| rng.gen_range(0..2)).collect();
        let hit = admit(&mut m, sequence, &prompt, None);
        // Whatever was reused must have been computed for exactly these leading tokens.
        let table = m.block_table(id(sequence)).unwrap().to_vec();
        for (other, other_prompt) in prompts.iter().enumerate() {
            if !m.contains(id(other as u64)) {
                continue;
            }
            let other_table = m.block_table(id(other as u64)).unwrap();
            for k in 0..hit / BS {
                if other_table.get(k) == Some(&table[k]) {
                    assert_eq!(other_prompt[..(k + 1) * BS], prompt[..(k + 1) * BS]);
                }
            }
        }
        prompts.push(prompt);
        if sequence >= 3 {
            m.free(id(sequence - 3)).unwrap();
        }
        m.pool().check_invariants().unwrap();
    }
}

#[test]
fn eviction_is_lru_with_chain_tails_first() {
    let mut m = manager(4);
    let prompt: Vec<u32> = (0..12).collect();
    admit(&mut m, 1, &prompt, None);
    let table = ids(m.block_table(id(1)).unwrap());
    m.free(id(1)).unwrap();
    let free_order: Vec<u32> = m.pool().free_blocks().map(|b| b.0).collect();
    // The never-used block first, then the chain tail to head.
    assert_eq!(free_order, vec![3, table[2], table[1], table[0]]);
    assert_eq!(m.stats().num_cached_free_blocks, 3);

    // Allocating two blocks evicts the unused block then the tail: the head survives.
    add(&mut m, 2, &[100, 101, 102, 103, 104], None);
    m.get_computed_blocks(id(2)).unwrap();
    m.allocate_slots(id(2), 5).unwrap().unwrap();
    assert_eq!(m.stats().num_evictions, 1);
    m.free(id(2)).unwrap();
    assert_eq!(admit(&mut m, 3, &prompt, None), 8);
    assert_eq!(ids(&m.block_table(id(3)).unwrap()[..2]), table[..2]);
}

#[test]
fn allocation_without_enough_blocks_returns_none_and_changes_nothing() {
    let mut m = manager(3);
    let prompt: Vec<u32> = (0..8).collect();
    admit(&mut m, 1, &prompt, None);
    add(&mut m, 2, &(50..62).collect::<Vec<u32>>(), None);
    m.get_computed_blocks(id(2)).unwrap();
    let before = m.stats();
    assert_eq!(m.allocate_slots(id(2), 12).unwrap(), None);
    assert_eq!(m.stats(), before);
    assert!(m.block_table(id(2)).unwrap().is_empty());
    assert_eq!(m.allocate_slots(id(2), 4).unwrap().map(|c| c.len()), Some(0));
    m.pool().check_invariants().unwrap();
}

#[test]
fn a_hit_on_free_cached_blocks_counts_them_as_taken() {
    // Three blocks: a cached chain of two free blocks plus one spare. A sequence that hits
    // both cached blocks and needs two more must be refused, not evict its own hit.
    let mut m = manager(3);
    let prompt: Vec<u32> = (0..8).collect();
    admit(&mut m, 1, &prompt, None);
    m.free(id(1)).unwrap();
    let mut longer = prompt.clone();
    longer.extend(20..29);
    add(&mut m, 2, &longer, None);
    assert_eq!(m.get_computed_blocks(id(2)).unwrap(), 8);
    assert_eq!(m.allocate_slots(id(2), 9).unwrap(), None);
    assert_eq!(m.allocate_slots(id(2), 4).unwrap(), Some(vec![]));
    assert_eq!(m.stats().num_evictions, 0);
    m.pool().check_invariants().unwrap();
}

#[test]
fn decode_appends_fill_blocks_that_are_then_cached() {
    let mut m = manager(8);
    admit(&mut m, 1, &[1, 2, 3], None);
    for token in [4, 5, 6] {
        m.append_token_ids(id(1), &[token]).unwrap();
        m.allocate_slots(id(1), 1).unwrap().unwrap();
    }
    assert_eq!(m.num_computed_tokens(id(1)).unwrap(), 6);
    assert_eq!(m.block_table(id(1)).unwrap().len(), 2);
    assert!(m.pool().is_cached(m.block_table(id(1)).unwrap()[0]));
    assert!(!m.pool().is_cached(m.block_table(id(1)).unwrap()[1]));
    // A new sequence with the generated text as prompt reuses the filled block.
    assert_eq!(admit(&mut m, 2, &[1, 2, 3, 4, 5, 6], None), 4);
}

#[test]
fn allocating_unknown_tokens_is_an_error() {
    let mut m = manager(8);
    add(&mut m, 1, &[1, 2, 3], None);
    assert!(matches!(m.allocate_slots(id(1), 4), Err(Error::InvalidArgument(_))));
    m.pool().check_invariants().unwrap();
}

#[test]
fn fork_shares_every_block_and_copies_the_partial_one_on_first_write() {
    let mut m = manager(8);
    admit(&mut m, 1, &[1, 2, 3, 4, 5, 6], None);
    fork(&mut m, 1, 2);
    fork(&mut m, 1, 3);
    let parent_table = ids(m.block_table(id(1)).unwrap());
    assert_eq!(ids(m.block_table(id(2)).unwrap()), parent_table);
    assert_eq!(m.pool().ref_count(BlockId(parent_table[1])), 3);
    assert_eq!(m.stats().num_used_blocks, 2);

    // The first child to write gets a private copy of the partial block.
    m.append_token_ids(id(2), &[7]).unwrap();
    let copies = m.allocate_slots(id(2), 1).unwrap().unwrap();
    let child_table = ids(m.block_table(id(2)).unwrap());
    assert_eq!(
        copies,
        vec![BlockCopy { src: BlockId(parent_table[1]), dst: BlockId(child_table[1]) }]
    );
    assert_eq!(child_table[0], parent_table[0]);
    assert_eq!(m.pool().ref_count(BlockId(parent_table[1])), 2);

    m.append_token_ids(id(3), &[8]).unwrap();
    assert_eq!(m.allocate_slots(id(3), 1).unwrap().unwrap().len(), 1);
    // The parent is now the last holder: it writes in place.
    m.append_token_ids(id(1), &[9]).unwrap();
    assert_eq!(m.allocate_slots(id(1), 1).unwrap(), Some(vec![]));
    assert_eq!(ids(m.block_table(id(1)).unwrap()), parent_table);
    for sequence in 1..=3 {
        m.free(id(sequence)).unwrap();
    }
    assert_eq!(m.num_free_blocks(), 8);
    m.pool().check_invariants().unwrap();
}

#[test]
fn misuse_is_an_error_not_a_panic() {
    let mut m = manager(4);
    assert!(matches!(KVCacheManager::new(0, 4, true, ""), Err(Error::InvalidArgument(_))));
    assert!(matches!(KVCacheManager::new(4, 0, true, ""), Err(Error::InvalidArgument(_))));
    admit(&mut m, 1, &[1, 2], None);
    assert!(matches!(m.add_sequence(&[], None), Err(Error::InvalidArgument(_))));
    assert!(matches!(m.get_computed_blocks(id(1)), Err(Error::InvalidArgument(_))));
    m.free(id(1)).unwrap();
    assert!(matches!(m.free(id(1)), Err(Error::UnknownRequest(_))));
    assert!(matches!(m.fork(id(1)), Err(Error::UnknownRequest(_))));
    assert!(matches!(m.allocate_slots(id(1), 1), Err(Error::UnknownRequest(_))));
    // The freed slot is reused, but the old handle never reaches the new sequence.
    add(&mut m, 2, &[5], None);
    assert_eq!(id(2).index(), id(1).index());
    assert!(matches!(m.append_token_ids(id(1), &[1]), Err(Error::UnknownRequest(_))));
    assert_eq!(m.token_ids(id(2)).unwrap(), &[5]);
    m.free(id(2)).unwrap();
    assert_eq!(m.num_free_blocks(), 4);
}

#[test]
fn stale_prefix_hit_is_refused() {
    let mut m = manager(3);
    let prompt: Vec<u32> = (0..9).collect();
    admit(&mut m, 1, &prompt, None);
    m.free(id(1)).unwrap();
    add(&mut m, 2, &prompt, None);
    assert_eq!(m.get_computed_blocks(id(2)).unwrap(), 8);
    // Another sequence evicts the whole chain between lookup and allocation.
    admit(&mut m, 3, &(40..52).collect::<Vec<u32>>(), None);
    assert!(matches!(m.allocate_slots(id(2), 1), Err(Error::StalePrefixHit(_))));
    m.pool().check_invariants().unwrap();
}

/// 100,000 random operations with a two-token vocabulary, so prefixes collide constantly,
/// and tight memory, so allocation fails and eviction runs often.
#[test]
fn randomized_operations_keep_every_invariant_and_free_every_block() {
    let mut rng = SmallRng::seed_from_u64(20261129);
    let num_blocks = 48;
    let mut m = manager(num_blocks);
    let mut live: Vec<SequenceId> = Vec::new();
    let mut allocations_refused = 0;
    for _ in 0..100_000 {
        match rng.gen_range(0..100) {
            // Admit a new sequence (lookup + first chunk).
            0..=24 => {
                let len = rng.gen_range(1..24);
                let prompt: Vec<u32> = (0..len).map(|_| rng.gen_range(0..2)).collect();
                let salt = if rng.gen_bool(0.1) { Some("s") } else { None };
                let sequence = m.add_sequence(&prompt, salt).unwrap();
                let hit = m.get_computed_blocks(sequence).unwrap();
                assert!(hit < len && hit.is_multiple_of(BS));
                let chunk = rng.gen_range(1..=len - hit);
                match m.allocate_slots(sequence, chunk).unwrap() {
                    Some(copies) => assert!(copies.is_empty()),
                    None => allocations_refused += 1,
                }
                live.push(sequence);
            }
            // Compute more of a sequence: the rest of its prompt, or a new decode token.
            25..=64 if !live.is_empty() => {
                let sequence = live[rng.gen_range(0..live.len())];
                let known = m.token_ids(sequence).unwrap().len();
                let computed = m.num_computed_tokens(sequence).unwrap();
                if computed == known {
                    m.append_token_ids(sequence, &[rng.gen_range(0..2)]).unwrap();
                }
                let remaining = m.token_ids(sequence).unwrap().len() - computed;
                if m.block_table(sequence).unwrap().is_empty() {
                    m.get_computed_blocks(sequence).unwrap();
                }
                let pending = m.pending_hit_blocks(sequence).unwrap().len() * BS;
                if remaining > pending {
                    let n = rng.gen_range(1..=remaining - pending);
                    if let Some(copies) = m.allocate_slots(sequence, n).unwrap() {
                        for copy in copies {
                            assert_eq!(m.pool().ref_count(copy.dst), 1);
                        }
                    }
                }
            }
            // Fork.
            65..=74 if !live.is_empty() => {
                let parent = live[rng.gen_range(0..live.len())];
                if !m.block_table(parent).unwrap().is_empty() {
                    live.push(m.fork(parent).unwrap());
                }
            }
            // Free.
            75..=99 if !live.is_empty() => {
                let sequence = live.swap_remove(rng.gen_range(0..live.len()));
                m.free(sequence).unwrap();
                assert!(matches!(m.free(sequence), Err(Error::UnknownRequest(_))));
            }
            _ => {}
        }
        m.pool().check_invariants().unwrap();
        let held: usize = live.iter().map(|&r| m.block_table(r).unwrap().len()).sum();
        assert!(m.stats().num_used_blocks <= held, "a block is used by no sequence");
    }
    assert!(allocations_refused > 0, "memory was never tight");
    assert!(m.stats().prefix_cache_hits > 0 && m.stats().num_evictions > 0);
    for sequence in live {
        m.free(sequence).unwrap();
    }
    assert_eq!(m.num_free_blocks(), num_blocks);
    assert_eq!(m.stats().num_used_blocks, 0);
    assert_eq!(m.num_sequences(), 0);
    m.pool().check_invariants().unwrap();
}

#[test]
fn reset_frees_blocks_but_keeps_tokens_and_reuses_the_cached_prefix() {
    let mut m = manager(8);
    admit(&mut m, 1, &[1, 2, 3, 4, 5, 6, 7, 8, 9], None);
    m.append_token_ids(id(1), &[10]).unwrap();
    m.allocate_slots(id(1), 1).unwrap().unwrap();
    m.reset(id(1)).unwrap();
    assert_eq!(m.num_free_blocks(), 8);
    assert_eq!(m.num_computed_tokens(id(1)).unwrap(), 0);
    assert_eq!(m.token_ids(id(1)).unwrap().len(), 10);
    assert_eq!(m.get_computed_blocks(id(1)).unwrap(), 8);
    m.allocate_slots(id(1), 2).unwrap().unwrap();
    assert_eq!(m.num_computed_tokens(id(1)).unwrap(), 10);
    m.free(id(1)).unwrap();
    m.pool().check_invariants().unwrap();
}

/// The windows of a Gemma-3-like model at block size 4: a full group, then sliding ones.
const GROUPS: [Option<usize>; 3] = [None, Some(6), Some(6)];

#[test]
fn a_sliding_group_releases_blocks_out_of_its_window() {
    let mut m = KVCacheManager::with_groups(64, BS, true, "test-model", &GROUPS).unwrap();
    admit(&mut m, 1, &(0..10).collect::<Vec<u32>>(), None);
    // Ten tokens: the last block a query at position 10 reads is (10 + 1 - 6) / 4 = 1.
    assert_eq!(m.num_held_blocks(id(1)).unwrap(), vec![3, 3, 3]);
    for token in 10..40 {
        m.append_token_ids(id(1), &[token]).unwrap();
        m.allocate_slots(id(1), 1).unwrap().unwrap();
        let held = m.num_held_blocks(id(1)).unwrap();
        assert_eq!(held[0], (token as usize + 1).div_ceil(BS), "the full group keeps every block");
        assert!(held[1..].iter().all(|&n| n <= 6_usize.div_ceil(BS) + 1), "{held:?} at {token}");
        m.pool().check_invariants().unwrap();
    }
    let table = m.block_tables(id(1)).unwrap().nth(1).unwrap().to_vec();
    assert!(table[..7].iter().all(|&block| block == BlockId::NULL), "{table:?}");
    m.free(id(1)).unwrap();
    assert_eq!(m.num_free_blocks(), 64);
}

#[test]
fn a_hit_needs_every_group_and_claims_only_the_window() {
    let mut m = KVCacheManager::with_groups(64, BS, true, "test-model", &GROUPS).unwrap();
    let prompt: Vec<u32> = (0..21).collect();
    admit(&mut m, 1, &prompt, None);
    m.free(id(1)).unwrap();
    add(&mut m, 2, &prompt, None);
    assert_eq!(m.get_computed_blocks(id(2)).unwrap(), 20);
    m.allocate_slots(id(2), 1).unwrap().unwrap();
    // A query at 20 reads from position 15, block 3, on: blocks 3 and 4 of each sliding group.
    assert_eq!(m.num_held_blocks(id(2)).unwrap(), vec![6, 3, 3]);
    assert_eq!(m.stats().prefix_cache_hits, 20);
    m.pool().check_invariants().unwrap();
}

#[test]
fn several_groups_need_a_full_first_group() {
    for windows in [vec![], vec![Some(4), None], vec![None, Some(0)]] {
        assert!(KVCacheManager::with_groups(8, BS, true, "", &windows).is_err(), "{windows:?}");
    }
    assert!(KVCacheManager::with_groups(8, BS, true, "", &[Some(4)]).is_ok());
}

/// Every key a query reads holds what was computed for that query's own prefix: the manager
/// is run against a model of the cache's contents (each slot records the salt and the
/// tokens up to its position), with random admissions, chunks, decodes, forks, preemptions
/// and frees, a two-token vocabulary, tight memory and (in one case) colliding keys.
#[test]
fn randomized_layer_groups_read_only_their_own_prefix() {
    type Contents = HashMap<(usize, usize), (Option<&'static str>, Vec<u32>)>;
    let cases: [(&[Option<usize>], u32); 5] = [
        (&[None], 0),
        (&[Some(5)], 0),
        (&[None, Some(6)], 0),
        (&[None, Some(3), Some(9), None], 0),
        (&[None, Some(6)], 3),
    ];
    for (case, &(windows, collision_bits)) in cases.iter().enumerate() {
        let mut rng = SmallRng::seed_from_u64(20261202 + case as u64);
        let num_blocks = 24 * windows.len();
        let mut m = KVCacheManager::with_groups(num_blocks, BS, true, "test", windows).unwrap();
        if collision_bits > 0 {
            m.force_hash_collisions_for_testing(collision_bits);
        }
        // Per group: (block, offset) -> (salt, tokens up to and including that position).
        let mut contents: Vec<Contents> = vec![HashMap::new(); windows.len()];
        let mut salts: HashMap<SequenceId, Option<&'static str>> = HashMap::new();
        let mut live: Vec<SequenceId> = Vec::new();
        let (mut hits, mut released) = (0, 0);
        for _ in 0..20_000 {
            let roll = rng.gen_range(0..100);
            if roll < 8 || live.is_empty() {
                let len = rng.gen_range(1..40);
                let prompt: Vec<u32> = (0..len).map(|_| rng.gen_range(0..2)).collect();
                let salt = if rng.gen_bool(0.2) { Some("s") } else { None };
                let sequence = m.add_sequence(&prompt, salt).unwrap();
                salts.insert(sequence, salt);
                live.push(sequence);
                continue;
            }
            let sequence = live[rng.gen_range(0..live.len())];
            if roll < 12 {
                if m.num_computed_tokens(sequence).unwrap() > 0 {
                    let child = m.fork(sequence).unwrap();
                    salts.insert(child, salts[&sequence]);
                    live.push(child);
                }
                continue;
            }
            if roll < 18 {
                live.retain(|&other| other != sequence);
                m.free(sequence).unwrap();
                continue;
            }
            if roll < 20 {
                m.reset(sequence).unwrap();
                continue;
            }
            let mut computed = m.num_computed_tokens(sequence).unwrap();
            if computed == m.token_ids(sequence).unwrap().len() {
                m.append_token_ids(sequence, &[rng.gen_range(0..2)]).unwrap();
            }
            if computed == 0 && m.block_table(sequence).unwrap().is_empty() {
                let hit = m.get_computed_blocks(sequence).unwrap();
                hits += usize::from(hit > 0);
                computed = hit;
            }
            let known = m.token_ids(sequence).unwrap().to_vec();
            let n = rng.gen_range(1..=known.len() - computed);
            let Some(copies) = m.allocate_slots(sequence, n).unwrap() else {
                continue;
            };
            for copy in &copies {
                for group in &mut contents {
                    for offset in 0..BS {
                        match group.get(&(copy.src.index(), offset)).cloned() {
                            Some(entry) => group.insert((copy.dst.index(), offset), entry),
                            None => group.remove(&(copy.dst.index(), offset)),
                        };
                    }
                }
            }
            let salt = salts[&sequence];
            let tables: Vec<Vec<BlockId>> =
                m.block_tables(sequence).unwrap().map(<[BlockId]>::to_vec).collect();
            released += usize::from(tables.iter().any(|table| table.contains(&BlockId::NULL)));
            for ((table, group), &window) in tables.iter().zip(&mut contents).zip(windows) {
                for position in computed..computed + n {
                    let slot = (table[position / BS].index(), position % BS);
                    group.insert(slot, (salt, known[..=position].to_vec()));
                }
                for query in computed..computed + n {
                    let first_key = window.map_or(0, |w| (query + 1).saturating_sub(w));
                    for key in first_key..=query {
                        let block = table[key / BS];
                        assert_ne!(block, BlockId::NULL, "case {case}: key {key} of query {query}");
                        let stored = group.get(&(block.index(), key % BS));
                        assert_eq!(
                            stored,
                            Some(&(salt, known[..=key].to_vec())),
                            "case {case}: key {key} of query {query} in {windows:?}"
                        );
                    }
                }
            }
            m.pool().check_invariants().unwrap();
        }
        eprintln!("case {case}: {hits} hits, {released} with released blocks");
        assert!(hits > 50, "case {case}: {hits} prefix hits");
        assert!(windows.iter().all(Option::is_none) || released > 50, "case {case}: {released}");
        for sequence in live {
            m.free(sequence).unwrap();
        }
        assert_eq!(m.num_free_blocks(), num_blocks, "case {case}");
        m.pool().check_invariants().unwrap();
    }
}
