//! Seeded randomized runs of the scheduler on a tight cache, with `check_invariants` after
//! every operation: thousands of requests with random lengths, `n`, priorities, salts and
//! aborts over a three-token vocabulary (to force prefix sharing), with and without
//! speculative steps.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::sequence::StopConditions;
use crate::speculative::{SpeculativeConfig, SpeculativeMethod};

/// Thousands of requests with random lengths, n, priorities and aborts on a tight cache.
#[test]
fn randomized_simulation_keeps_invariants_and_ends_with_every_block_free() {
    randomized_simulation(None);
}

/// The same with speculative steps: proposals accepted at random.
#[test]
fn randomized_speculative_simulation_keeps_invariants_and_ends_with_every_block_free() {
    let s = randomized_simulation(Some(SpeculativeConfig {
        method: SpeculativeMethod::Ngram { min_n: 1, max_n: 2 },
        num_speculative_tokens: 4,
        disable_by_batch_size: Some(10),
    }));
    let stats = s.stats();
    assert!(stats.num_drafts_total > 1000, "{stats:?}");
    assert!(stats.num_accepted_tokens_total > 1000, "{stats:?}");
}

fn randomized_simulation(speculative: Option<SpeculativeConfig>) -> Scheduler {
    let mut rng = SmallRng::seed_from_u64(99);
    let cfg = SchedulerConfig {
        num_blocks: 40,
        block_size: 4,
        max_num_batched_tokens: 32,
        max_num_seqs: 12,
        max_model_len: 96,
        policy: SchedulingPolicy::Priority,
        long_prefill_token_threshold: Some(12),
        max_num_partial_prefills: 2,
        speculative,
        ..Default::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    let mut live: Vec<String> = Vec::new();
    let mut next = 0;
    let mut finished = 0;
    while next < 3000 || s.has_unfinished_requests() {
        if next < 3000 && rng.gen_bool(0.4) {
            let id = format!("r{next}");
            let len = rng.gen_range(1..60);
            let tokens: Vec<u32> = (0..len).map(|_| rng.gen_range(0..3)).collect();
            let p = RequestParams {
                stop: StopConditions {
                    max_tokens: rng.gen_range(1..30),
                    eos_token_id: Some(0),
                    min_tokens: 1,
                    ..Default::default()
                },
                n: rng.gen_range(1..=3),
                priority: rng.gen_range(-2..3),
                cache_salt: rng.gen_bool(0.2).then(|| "salt".to_owned()),
                arrival_time: None,
                speculate: rng.gen_bool(0.9),
                prompt_logprobs: rng.gen_bool(0.05),
            };
            s.add_request(&id, &tokens, p).unwrap();
            s.check_invariants().unwrap();
            live.push(id);
            next += 1;
        }
        if !live.is_empty() && rng.gen_bool(0.05) {
            let id = live.swap_remove(rng.gen_range(0..live.len()));
            let _ = s.abort_request(&id); // may have finished already
            s.check_invariants().unwrap();
        }
        let out = s.schedule().unwrap();
        s.check_invariants().unwrap();
        assert!(out.num_batched_tokens() <= 32);
        assert!(out.sequence_ids.len() <= 12);
        assert_eq!(
            out.query_start_loc.last().copied().unwrap_or(0) as usize,
            out.num_batched_tokens()
        );
        // A row accepts its proposal with probability 0.6.
        let sampled: Vec<u32> =
            out.logits_draft_token_ids
                .iter()
                .map(|&draft| {
                    if draft >= 0 && rng.gen_bool(0.6) {
                        draft as u32
                    } else {
                        rng.gen_range(0..5)
                    }
                })
                .collect();
        for update in s.update_from_output(&sampled).unwrap() {
            finished += usize::from(update.finish_reason.is_some());
        }
        s.check_invariants().unwrap();
        assert!(s.num_running() <= 12);
    }
    assert!(finished > 1000);
    assert!(s.stats().num_preemptions_total > 0, "memory was never tight");
    assert!(s.stats().prefix_cache_hits > 0);
    assert_eq!(s.kv_cache().num_free_blocks(), 40);
    assert_eq!(s.kv_cache().num_sequences(), 0);
    assert_eq!((s.requests.len(), s.requests.num_external_ids()), (0, 0));
    s
}
