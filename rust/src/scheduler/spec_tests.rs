//! Speculative decoding through the scheduler, against a fake model whose next token is a
//! function of the context: with or without proposals, every choice must get exactly the
//! same tokens, and the KV each row attends to must hold exactly its context.

use std::collections::HashMap;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::sequence::StopConditions;
use crate::speculative::{SpeculativeConfig, SpeculativeMethod};

/// The fake model: the next token after `context` for choice `choice`. Mostly repeats the
/// token 4 back (so proposals are often right), sometimes something else.
fn next_token(context: &[u32], choice: usize) -> u32 {
    let mut h = 1469598103934665603u64 ^ choice as u64;
    for &token in &context[context.len().saturating_sub(3)..] {
        h = (h ^ u64::from(token)).wrapping_mul(1099511628211);
    }
    if !h.is_multiple_of(5) && context.len() >= 4 {
        context[context.len() - 4]
    } else {
        (h >> 7) as u32 % 6
    }
}

/// Each choice's tokens and finish reason, by (request id, choice).
type Results = HashMap<(String, usize), (Vec<u32>, Option<FinishReason>)>;

/// What the KV cache holds, slot by slot: (token, position) written there.
type KvStore = HashMap<i64, (i64, i64)>;

/// Runs one step against the fake model, checking the KV every row attends to. For
/// `DraftModel`, the harness proposes (mostly right) tokens itself, as a draft model would.
fn run_step(s: &mut Scheduler, kv: &mut KvStore, rng: &mut SmallRng) -> Vec<SequenceUpdate> {
    let mut out = s.schedule().unwrap();
    s.check_invariants().unwrap();
    let block_size = s.config.block_size;
    let caller_proposes = s.spec.as_ref().is_some_and(SpecState::caller_proposes);
    let mut contexts: Vec<Vec<u32>> = Vec::new();
    let mut external_drafts = Vec::new();
    for (i, &id) in out.sequence_ids.iter().enumerate() {
        let (start, end) = (out.query_start_loc[i] as usize, out.query_start_loc[i + 1] as usize);
        let first_position = out.positions[start] as usize;
        let known = s.kv.token_ids(id).unwrap();
        let num_drafts = out.num_draft_tokens[i] as usize;
        let mut context: Vec<u32> = known[..first_position + (end - start) - num_drafts].to_vec();
        if caller_proposes && num_drafts > 0 {
            let choice = out.choice_indices[i] as usize;
            for _ in 0..num_drafts {
                let token = if rng.gen_bool(0.8) { next_token(&context, choice) } else { 5 };
                context.push(token);
                external_drafts.push(token);
            }
            for (row, &token) in (end - num_drafts..end).zip(&context[context.len() - num_drafts..])
            {
                out.input_token_ids[row] = i64::from(token);
            }
        } else {
            context.extend(out.input_token_ids[end - num_drafts..end].iter().map(|&t| t as u32));
        }
        contexts.push(context);
    }
    for copy in &out.block_copies {
        for offset in 0..block_size as i64 {
            let src = i64::from(copy.src.0) * block_size as i64 + offset;
            let dst = i64::from(copy.dst.0) * block_size as i64 + offset;
            match kv.get(&src).copied() {
                Some(entry) => kv.insert(dst, entry),
                None => kv.remove(&dst),
            };
        }
    }
    for row in 0..out.num_batched_tokens() {
        kv.insert(out.slot_mapping[row], (out.input_token_ids[row], out.positions[row]));
    }
    let width = out.block_table_width;
    for (i, context) in contexts.iter().enumerate() {
        assert_eq!(out.context_lens[i] as usize, context.len());
        for (position, &token) in context.iter().enumerate() {
            let block = out.block_tables[i * width + position / block_size] as i64;
            let slot = block * block_size as i64 + (position % block_size) as i64;
            assert_eq!(
                kv.get(&slot).copied(),
                Some((i64::from(token), position as i64)),
                "sequence {i} reads the wrong KV at position {position}"
            );
        }
    }
    let sampled: Vec<u32> = (0..out.logits_indices.len())
        .map(|row| {
            let seq = out.logits_request_indices[row] as usize;
            let input_row = out.logits_indices[row] as usize;
            let start = out.query_start_loc[seq] as usize;
            let len = out.positions[start] as usize + (input_row - start) + 1;
            next_token(&contexts[seq][..len], out.logits_choice_indices[row] as usize)
        })
        .collect();
    let drafts = caller_proposes.then_some(external_drafts.as_slice());
    let updates = s.update_from_output_with_drafts(&sampled, drafts).unwrap();
    s.check_invariants().unwrap();
    updates
}

struct Workload {
    prompts: Vec<Vec<u32>>,
    params: Vec<RequestParams>,
}

fn workload(seed: u64, num_requests: usize) -> Workload {
    let mut rng = SmallRng::seed_from_u64(seed);
    let shared: Vec<u32> = (0..12).map(|_| rng.gen_range(0..6)).collect();
    let mut prompts = Vec::new();
    let mut params = Vec::new();
    for _ in 0..num_requests {
        let len = rng.gen_range(1..30);
        let mut prompt: Vec<u32> = if rng.gen_bool(0.3) { shared.clone() } else { Vec::new() };
        prompt.extend((0..len).map(|_| rng.gen_range(0..6)));
        prompts.push(prompt);
        params.push(RequestParams {
            stop: StopConditions {
                max_tokens: rng.gen_range(3..40),
                eos_token_id: rng.gen_bool(0.3).then_some(5),
                stop_token_ids: if rng.gen_bool(0.2) { vec![4] } else { Vec::new() },
                min_tokens: rng.gen_range(0..3),
                ..Default::default()
            },
            n: rng.gen_range(1..=3),
            speculate: rng.gen_bool(0.9),
            ..Default::default()
        });
    }
    Workload { prompts, params }
}

/// Runs the workload to the end (requests arriving over the first steps); returns each
/// choice's tokens and finish reason, and the scheduler.
fn run(
    speculative: Option<SpeculativeConfig>,
    work: &Workload,
    num_blocks: usize,
) -> (Results, Scheduler) {
    let config = SchedulerConfig {
        num_blocks,
        block_size: 4,
        max_num_batched_tokens: 24,
        max_num_seqs: 8,
        max_model_len: 64,
        long_prefill_token_threshold: Some(10),
        max_num_partial_prefills: 2,
        speculative,
        ..Default::default()
    };
    let mut s = Scheduler::new(config).unwrap();
    let mut kv = KvStore::new();
    let mut rng = SmallRng::seed_from_u64(7);
    let mut results = Results::new();
    let mut next = 0;
    let mut steps = 0;
    while next < work.prompts.len() || s.has_unfinished_requests() {
        for _ in 0..2 {
            if next < work.prompts.len() {
                let id = format!("r{next}");
                s.add_request(&id, &work.prompts[next], work.params[next].clone()).unwrap();
                s.check_invariants().unwrap();
                next += 1;
            }
        }
        for update in run_step(&mut s, &mut kv, &mut rng) {
            // Handles are issued in order: request `r{i}` has handle i.
            let id = format!("r{}", update.request.0);
            let entry = results.entry((id, update.choice_index)).or_default();
            entry.0.extend(update.new_token_id);
            if update.finish_reason.is_some() {
                entry.1 = update.finish_reason;
            }
        }
        steps += 1;
        assert!(steps < 20_000, "no progress");
    }
    assert_eq!(s.kv.num_free_blocks(), num_blocks, "every block is free again");
    assert_eq!(s.kv.num_sequences(), 0);
    (results, s)
}

fn spec(method: SpeculativeMethod, k: usize) -> Option<SpeculativeConfig> {
    Some(SpeculativeConfig { method, num_speculative_tokens: k, disable_by_batch_size: None })
}

fn suffix() -> SpeculativeMethod {
    SpeculativeMethod::Suffix {
        max_depth: 12,
        min_token_prob: 0.1,
        max_spec_factor: 2.0,
        max_cached_requests: 16,
    }
}

#[test]
fn every_method_gives_the_same_tokens_as_plain_decoding_with_preemption_and_prefix_hits() {
    let work = workload(3, 120);
    let (expected, plain) = run(None, &work, 30);
    assert!(plain.stats().num_preemptions_total > 0, "memory was never tight");
    assert!(plain.stats().prefix_cache_hits > 0);
    let methods = [
        spec(SpeculativeMethod::Ngram { min_n: 1, max_n: 3 }, 3),
        spec(suffix(), 4),
        spec(SpeculativeMethod::DraftModel, 3),
    ];
    for method in methods {
        let name = format!("{:?}", method.as_ref().unwrap().method);
        let (got, s) = run(method, &work, 30);
        assert_eq!(got.len(), expected.len(), "{name}");
        for (key, tokens) in &expected {
            assert_eq!(got.get(key), Some(tokens), "{name}: {key:?}");
        }
        let stats = s.stats();
        assert!(stats.num_drafts_total > 50, "{name}: {stats:?}");
        assert!(stats.num_accepted_tokens_total > 50, "{name}: {stats:?}");
        assert!(stats.num_accepted_tokens_total <= stats.num_draft_tokens_total);
        assert_eq!(
            stats.num_accepted_tokens_per_pos.iter().sum::<u64>(),
            stats.num_accepted_tokens_total
        );
        assert!(stats.num_preemptions_total > 0, "{name}: memory was never tight");
    }
}

#[test]
fn proposals_fit_the_budget_and_never_pass_max_tokens() {
    let config =
        SchedulerConfig { max_num_batched_tokens: 8, max_num_seqs: 4, ..external_config(64, 5) };
    let mut s = Scheduler::new(config).unwrap();
    for i in 0..3 {
        let p = RequestParams {
            stop: StopConditions { max_tokens: 4, ..Default::default() },
            ..Default::default()
        };
        s.add_request(&format!("r{i}"), &[1, 2, 3], p).unwrap();
    }
    let mut kv = KvStore::new();
    let mut rng = SmallRng::seed_from_u64(1);
    let mut lengths = HashMap::new();
    while s.has_unfinished_requests() {
        let updates = run_step(&mut s, &mut kv, &mut rng);
        for update in updates {
            *lengths.entry(update.request).or_insert(0) += 1;
        }
    }
    assert!(lengths.values().all(|&n| n == 4), "{lengths:?}");
    assert!(s.stats().num_drafts_total > 0);
}

#[test]
fn proposals_never_take_the_token_of_a_decode_behind() {
    let config =
        SchedulerConfig { max_num_batched_tokens: 8, max_num_seqs: 4, ..external_config(256, 5) };
    let mut s = Scheduler::new(config).unwrap();
    for i in 0..4 {
        s.add_request(&format!("r{i}"), &[1, 2], params_max(500)).unwrap();
    }
    let mut kv = KvStore::new();
    let mut rng = SmallRng::seed_from_u64(1);
    run_step(&mut s, &mut kv, &mut rng); // four prompts
    for _ in 0..10 {
        let before: Vec<usize> = ["r0", "r1", "r2", "r3"]
            .iter()
            .map(|id| s.kv.token_ids(s.live_choice(id, 0).unwrap()).unwrap().len())
            .collect();
        run_step(&mut s, &mut kv, &mut rng);
        for (i, id) in ["r0", "r1", "r2", "r3"].iter().enumerate() {
            let now = s.kv.token_ids(s.live_choice(id, 0).unwrap()).unwrap().len();
            assert!(now > before[i], "{id} got no token this step");
        }
    }
    assert!(s.stats().num_drafts_total > 0);
}

#[test]
fn proposals_never_take_the_block_a_decode_behind_needs() {
    // Two sequences of 5 tokens: each next token (position 4) needs a new block, and 2 are
    // free. Proposals of the first (positions 5..8) would take both: the second would be
    // preempted. They are dropped instead.
    let config = external_config(4, 4);
    let mut s = Scheduler::new(config).unwrap();
    s.add_request("a", &[1, 2, 3, 4], params_max(10)).unwrap();
    s.add_request("b", &[5, 6, 7, 8], params_max(10)).unwrap();
    s.schedule().unwrap();
    s.update_from_output(&[9, 9]).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.num_draft_tokens, vec![0, 0]);
    assert!(out.preempted.is_empty());
    assert_eq!(out.num_scheduled_tokens, vec![1, 1]);
}

#[test]
fn no_sequence_speculates_in_a_batch_at_the_disable_size() {
    let config = SchedulerConfig {
        num_blocks: 64,
        block_size: 4,
        speculative: Some(SpeculativeConfig {
            method: SpeculativeMethod::DraftModel,
            num_speculative_tokens: 2,
            disable_by_batch_size: Some(2),
        }),
        ..Default::default()
    };
    let mut s = Scheduler::new(config).unwrap();
    s.add_request("a", &[1, 2], params_max(20)).unwrap();
    s.add_request("b", &[1, 2], params_max(3)).unwrap();
    let mut kv = KvStore::new();
    let mut rng = SmallRng::seed_from_u64(1);
    let mut spec_steps_with_two = 0;
    while s.has_unfinished_requests() {
        let running = s.num_running();
        let before = s.stats().num_drafts_total;
        run_step(&mut s, &mut kv, &mut rng);
        if running >= 2 {
            spec_steps_with_two += s.stats().num_drafts_total - before;
        }
    }
    assert_eq!(spec_steps_with_two, 0);
    assert!(s.stats().num_drafts_total > 0, "a alone speculates");
}

/// A small scheduler whose proposals come from the caller (`k` at most).
fn external_config(num_blocks: usize, k: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size: 4,
        speculative: spec(SpeculativeMethod::DraftModel, k),
        ..Default::default()
    }
}

fn params_max(max_tokens: usize) -> RequestParams {
    RequestParams {
        stop: StopConditions { max_tokens, ..Default::default() },
        ..Default::default()
    }
}

#[test]
fn rejected_proposals_release_their_blocks_and_are_never_cached() {
    let config = external_config(16, 6);
    let mut s = Scheduler::new(config).unwrap();
    s.add_request("a", &[1, 2, 3, 4], params_max(20)).unwrap();
    s.schedule().unwrap();
    s.update_from_output(&[9]).unwrap(); // prompt done: tokens 1 2 3 4 9
    let out = s.schedule().unwrap();
    assert_eq!(out.num_draft_tokens, vec![6]);
    // 9 at position 4 and six proposals: positions 4..11, blocks 1 and 2 (block 0 is full).
    assert_eq!(s.kv.block_table(out.sequence_ids[0]).unwrap().len(), 3);
    // The first proposal is accepted, the second corrected: two tokens appended.
    let updates = s
        .update_from_output_with_drafts(&[7, 8, 0, 0, 0, 0, 0], Some(&[7, 1, 1, 1, 1, 1]))
        .unwrap();
    let tokens: Vec<_> = updates.iter().map(|u| u.new_token_id.unwrap()).collect();
    assert_eq!(tokens, vec![7, 8]);
    let id = out.sequence_ids[0];
    assert_eq!(s.kv.token_ids(id).unwrap(), &[1, 2, 3, 4, 9, 7, 8]);
    assert_eq!(s.kv.num_computed_tokens(id).unwrap(), 6);
    assert_eq!(s.kv.block_table(id).unwrap().len(), 2, "the block of rejected proposals is free");
    assert_eq!(s.stats().num_accepted_tokens_total, 1);
    assert_eq!(s.stats().num_accepted_tokens_per_pos[..2], [1, 0]);
    // Only block 0 (verified) is cached: a request with the same 7 tokens hits 4 of them.
    s.add_request("b", &[1, 2, 3, 4, 9, 7, 1, 1], params_max(1)).unwrap();
    s.schedule().unwrap();
    assert_eq!(s.num_cached_tokens(s.request_handle("b").unwrap()), Some(4));
}

#[test]
fn caller_proposals_must_match_the_schedule() {
    let config = external_config(16, 2);
    let mut s = Scheduler::new(config).unwrap();
    s.add_request("a", &[1, 2], params_max(20)).unwrap();
    s.schedule().unwrap();
    s.update_from_output(&[3]).unwrap();
    s.schedule().unwrap();
    let err = s.update_from_output_with_drafts(&[1, 2, 3], Some(&[1])).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)));
    let err = s.update_from_output(&[1, 2, 3]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(message) if message.contains("draft_token_ids")));
    assert!(s.update_from_output_with_drafts(&[1, 2, 3], Some(&[1, 2])).is_ok());
}

#[test]
fn a_sequence_whose_proposals_keep_failing_backs_off_and_recovers_on_a_hit() {
    let config = external_config(64, 2);
    let mut s = Scheduler::new(config).unwrap();
    s.add_request("a", &[1, 2], params_max(200)).unwrap();
    s.schedule().unwrap();
    s.update_from_output(&[3]).unwrap();
    let mut speculative_steps = Vec::new();
    for step in 0..60 {
        let out = s.schedule().unwrap();
        let num_drafts = out.num_draft_tokens[0] as usize;
        if num_drafts > 0 {
            speculative_steps.push(step);
        }
        // Every proposal is wrong (the placeholders are 0, the model says 9), except at step 40.
        let mut sampled = vec![9; num_drafts + 1];
        if step >= 40 && num_drafts > 0 {
            sampled[0] = 0;
        }
        s.update_from_output_with_drafts(&sampled, Some(&vec![0; num_drafts])).unwrap();
    }
    // Misses at 0, then after 1, 3, 7, 15, 15 ... steps of waiting.
    assert_eq!(&speculative_steps[..5], &[0, 2, 6, 14, 30], "{speculative_steps:?}");
    // The first proposal accepted (at or after step 40) resets the back-off: the next step
    // proposes again.
    let first_hit = *speculative_steps.iter().find(|&&step| step >= 40).unwrap();
    assert!(speculative_steps.contains(&(first_hit + 1)), "{speculative_steps:?}");
}

#[test]
fn proposal_length_follows_the_last_acceptance() {
    let mut s = Scheduler::new(external_config(64, 6)).unwrap();
    s.add_request("a", &[1, 2], params_max(200)).unwrap();
    s.schedule().unwrap();
    s.update_from_output(&[3]).unwrap();
    // (proposals expected this step, how many of them are accepted)
    let steps = [
        (6, 2), // k at first; 2 of 6 accepted: next 3
        (3, 3), // all accepted: next 3 + 2
        (5, 5), // all accepted: next 7, capped at k
        (6, 0), // none: next 1, after sitting out a step
        (0, 0),
        (1, 1), // all accepted: next at least 1 + 2
        (3, 0),
    ];
    for (step, (expected, accepted)) in steps.into_iter().enumerate() {
        let out = s.schedule().unwrap();
        let num_drafts = out.num_draft_tokens[0] as usize;
        assert_eq!(num_drafts, expected, "step {step}");
        // Rows before `accepted` sample their placeholder 0 (accepted); the next samples 9.
        let sampled: Vec<u32> =
            (0..=num_drafts).map(|row| if row < accepted { 0 } else { 9 }).collect();
        s.update_from_output_with_drafts(&sampled, Some(&vec![0; num_drafts])).unwrap();
    }
}
