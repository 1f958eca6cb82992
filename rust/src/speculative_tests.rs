use super::*;

fn ngram() -> SpeculativeMethod {
    SpeculativeMethod::Ngram { min_n: 1, max_n: 3 }
}

fn suffix(max_depth: usize) -> SpeculativeMethod {
    SpeculativeMethod::Suffix {
        max_depth,
        min_token_prob: 0.1,
        max_spec_factor: 2.0,
        max_cached_requests: 2,
    }
}

fn propose(
    drafter: &mut Drafter,
    method: &SpeculativeMethod,
    tokens: &[u32],
    k: usize,
) -> Vec<u32> {
    let mut out = vec![99];
    drafter.propose(method, tokens, k, None, &mut out);
    out
}

#[test]
fn ngram_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix() {
    let method = ngram();
    let mut drafter = Drafter::new(&method);
    // "5 6 7" occurs at 0 followed by 8 9, and "6 7" at 5 followed by 1: the longest wins.
    let tokens = [5, 6, 7, 8, 9, 6, 7, 1, 2, 5, 6, 7];
    assert_eq!(propose(&mut drafter, &method, &tokens, 2), vec![8, 9]);
    // Only "7" matches now (latest occurrence at 6, followed by 1 2 5 ...).
    let tokens = [5, 6, 7, 8, 9, 6, 7, 1, 2, 5, 6, 7, 3, 7];
    assert_eq!(propose(&mut drafter, &method, &tokens, 3), vec![3, 7]);
    let mut fresh = Drafter::new(&method);
    assert_eq!(propose(&mut fresh, &method, &[4, 4, 1], 3), Vec::<u32>::new());
}

#[test]
fn ngram_index_grows_incrementally_and_matches_a_rebuilt_one() {
    let method = ngram();
    let tokens: Vec<u32> = (0..400).map(|i| (i * 7 % 13) as u32 % 5).collect();
    let mut incremental = Drafter::new(&method);
    for len in 1..tokens.len() {
        let mut fresh = Drafter::new(&method);
        let grown = propose(&mut incremental, &method, &tokens[..len], 4);
        assert_eq!(grown, propose(&mut fresh, &method, &tokens[..len], 4), "at {len}");
    }
}

#[test]
fn ngram_never_proposes_past_the_known_tokens_or_the_limit() {
    let method = ngram();
    let mut drafter = Drafter::new(&method);
    assert_eq!(propose(&mut drafter, &method, &[3, 3, 3, 3], 5), vec![3]);
    assert_eq!(propose(&mut drafter, &method, &[1, 2, 3, 1, 2, 3, 1, 2], 0), Vec::<u32>::new());
}

#[test]
fn suffix_follows_the_most_frequent_continuation() {
    let method = suffix(8);
    let mut drafter = Drafter::new(&method);
    // After "1 2", "3 4" followed twice and "9" once.
    let tokens = [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 9, 0, 1, 2];
    assert_eq!(propose(&mut drafter, &method, &tokens, 3), vec![3, 4, 0]);
}

#[test]
fn suffix_stops_when_the_path_becomes_unlikely() {
    let method = SpeculativeMethod::Suffix {
        max_depth: 8,
        min_token_prob: 0.6,
        max_spec_factor: 4.0,
        max_cached_requests: 0,
    };
    let mut drafter = Drafter::new(&method);
    // After "7", 8 followed 2 of 3 times (p = 2/3 with the current occurrence counted in):
    // proposals continue only while the product stays >= 0.6.
    let tokens = [7, 8, 1, 7, 8, 2, 7, 5, 7];
    let proposal = propose(&mut drafter, &method, &tokens, 4);
    assert!(proposal.len() <= 1, "{proposal:?}");
}

#[test]
fn suffix_cache_proposes_from_finished_outputs_and_forgets_the_oldest() {
    let method = suffix(8);
    let mut cache = SuffixCache::new(8, 2);
    cache.insert(&[10, 11, 12, 13]);
    let mut drafter = Drafter::new(&method);
    let mut out = Vec::new();
    drafter.propose(&method, &[4, 5, 10, 11], 2, Some(&cache.trie), &mut out);
    assert_eq!(out, vec![12, 13]);
    cache.insert(&[20, 21]);
    cache.insert(&[30, 31]);
    assert_eq!(cache.len(), 2);
    let mut fresh = Drafter::new(&method);
    fresh.propose(&method, &[4, 5, 10, 11], 2, Some(&cache.trie), &mut out);
    assert_eq!(out, Vec::<u32>::new(), "the oldest output was forgotten");
    fresh.propose(&method, &[20], 2, Some(&cache.trie), &mut out);
    assert_eq!(out, vec![21]);
}

#[test]
fn suffix_cache_counts_return_to_zero_when_every_output_is_forgotten() {
    let mut cache = SuffixCache::new(6, 3);
    let mut rng = 12345u64;
    for _ in 0..50 {
        let len = 1 + (rng % 20) as usize;
        let output: Vec<u32> = (0..len)
            .map(|_| {
                rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((rng >> 33) % 4) as u32
            })
            .collect();
        cache.insert(&output);
    }
    for _ in 0..3 {
        cache.insert(&[]); // ignored: nothing to index
    }
    let outputs: Vec<Vec<u32>> = cache.outputs.iter().cloned().collect();
    for output in outputs {
        cache.trie.remove_text(&output);
    }
    assert!(cache.trie.nodes[1..].iter().all(|node| node.count == 0));
    assert!(cache.trie.nodes.iter().all(|node| node.best_child.is_none()));
    assert_eq!(cache.trie.num_live_nodes(), 1, "only the root is left");
    assert!(cache.trie.edges.is_empty());
}

#[test]
fn suffix_cache_memory_stays_bounded_by_the_outputs_it_keeps() {
    let mut cache = SuffixCache::new(8, 4);
    let mut peak = 0;
    for i in 0..2000u32 {
        // Distinct outputs: every one adds new paths.
        let output: Vec<u32> = (0..30).map(|t| i * 31 + t).collect();
        cache.insert(&output);
        peak = peak.max(cache.trie.nodes.len());
    }
    // Four outputs of 30 tokens hold at most 4 * 30 * 8 paths.
    assert!(peak <= 1 + 5 * 30 * 8, "{peak} nodes");
    let mut drafter = Drafter::new(&suffix(8));
    let mut out = Vec::new();
    drafter.propose(&suffix(8), &[1999 * 31 + 2, 1999 * 31 + 3], 3, Some(&cache.trie), &mut out);
    assert_eq!(out, vec![1999 * 31 + 4, 1999 * 31 + 5, 1999 * 31 + 6]);
}

#[test]
fn draft_model_proposals_are_placeholders_of_the_asked_length() {
    let method = SpeculativeMethod::DraftModel;
    let mut drafter = Drafter::new(&method);
    assert_eq!(propose(&mut drafter, &method, &[1, 2, 3], 3), vec![0, 0, 0]);
}

#[test]
fn bad_settings_are_refused() {
    let config = |method, k| SpeculativeConfig {
        method,
        num_speculative_tokens: k,
        disable_by_batch_size: None,
    };
    assert!(config(ngram(), 0).validate().is_err());
    assert!(config(ngram(), MAX_SPECULATIVE_TOKENS + 1).validate().is_err());
    assert!(config(SpeculativeMethod::Ngram { min_n: 3, max_n: 2 }, 2).validate().is_err());
    assert!(config(SpeculativeMethod::Ngram { min_n: 0, max_n: 2 }, 2).validate().is_err());
    assert!(config(suffix(1), 2).validate().is_err());
    assert!(config(ngram(), 4).validate().is_ok());
    assert!(config(suffix(24), 4).validate().is_ok());
}
