//! The fair share (`max_seqs_per_request`): a wide request alone takes every seat, gives
//! seats back when another request arrives, and takes them again when it is alone; a
//! seeded randomized run checks the share after every step and that no request starves.

use std::collections::HashMap;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::tests::{prompt, step};
use super::*;
use crate::sequence::{RequestHandle, StopConditions};

fn config(share: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks: 256,
        block_size: 4,
        max_num_batched_tokens: 64,
        max_num_seqs: 8,
        max_model_len: 1024,
        max_seqs_per_request: Some(share),
        ..Default::default()
    }
}

fn params(max_tokens: usize, n: usize) -> RequestParams {
    RequestParams {
        stop: StopConditions { max_tokens, ..Default::default() },
        n,
        ..Default::default()
    }
}

impl Scheduler {
    /// Seats each request holds: running sequences plus reserved forks.
    fn seats_by_request(&self) -> HashMap<RequestHandle, usize> {
        let mut seats = HashMap::new();
        for &id in &self.running {
            let seq = &self.sequences[id];
            *seats.entry(seq.request).or_insert(0) += 1 + seq.num_reserved_forks;
        }
        seats
    }

    fn seats_of(&self, external_id: &str) -> usize {
        let handle = self.requests.handle(external_id).expect("live");
        self.seats_by_request().get(&handle).copied().unwrap_or(0)
    }
}

#[test]
fn a_request_alone_takes_every_seat() {
    let mut s = Scheduler::new(config(2)).unwrap();
    s.add_request("wide", &prompt(6, 0), params(4, 6)).unwrap();
    let (_, updates) = step(&mut s, 5);
    assert_eq!(updates.len(), 6, "every choice's first token comes from the prompt's logits");
    assert_eq!(s.num_running(), 6);
    assert_eq!(s.stats().num_fair_share_requeues_total, 0);
}

#[test]
fn a_wide_request_gives_seats_back_when_another_arrives_and_takes_them_again_alone() {
    let mut s = Scheduler::new(config(2)).unwrap();
    s.add_request("wide", &prompt(6, 0), params(6, 6)).unwrap();
    step(&mut s, 5);
    step(&mut s, 5);
    assert_eq!(s.num_running(), 6);
    s.add_request("small", &prompt(5, 100), params(3, 1)).unwrap();
    let small = s.request_handle("small").unwrap();
    let (out, updates) = step(&mut s, 5);
    // Four choices gave their seats back, last in queue order first, and the small
    // request was admitted in the same step.
    assert_eq!(out.preempted.len(), 4);
    assert_eq!(s.stats().num_fair_share_requeues_total, 4);
    assert_eq!(s.stats().num_preemptions_total, 0, "not a preemption for want of blocks");
    assert_eq!(out.sequence_ids.len(), 3);
    assert_eq!(s.seats_of("wide"), 2);
    assert_eq!(s.seats_of("small"), 1);
    let mut tokens_by_choice = [2usize; 6];
    for update in updates.iter().filter(|update| update.request != small) {
        tokens_by_choice[update.choice_index] += 1;
    }
    let mut small_done = false;
    while !small_done {
        let (_, updates) = step(&mut s, 5);
        for update in updates {
            if update.request == small {
                small_done |= update.finish_reason.is_some();
            } else {
                tokens_by_choice[update.choice_index] += 1;
            }
        }
        if !small_done {
            assert_eq!(s.seats_of("wide"), 2);
        }
    }
    // Alone again: the waiting choices come back, all at once.
    let (out, updates) = step(&mut s, 5);
    assert_eq!(out.sequence_ids.len(), 6);
    assert_eq!(s.num_waiting(), 0);
    for update in updates {
        tokens_by_choice[update.choice_index] += 1;
    }
    while s.has_unfinished_requests() {
        for update in step(&mut s, 5).1 {
            tokens_by_choice[update.choice_index] += 1;
        }
    }
    assert_eq!(tokens_by_choice, [6; 6], "every choice gets all its tokens");
    assert_eq!(s.kv_cache().num_free_blocks(), 256);
}

#[test]
fn a_prompt_admitted_beside_another_reserves_only_its_share_and_its_other_forks_wait() {
    let mut s = Scheduler::new(config(3)).unwrap();
    s.add_request("small", &prompt(5, 100), params(20, 1)).unwrap();
    step(&mut s, 5);
    s.add_request("wide", &prompt(6, 0), params(4, 6)).unwrap();
    let (out, updates) = step(&mut s, 5);
    assert_eq!(out.logits_indices.len(), 1 + 6, "small's decode, then all six choices' rows");
    assert_eq!(updates.len(), 7);
    assert_eq!(s.seats_of("wide"), 3);
    assert_eq!(s.num_waiting(), 3, "the forks past the reserved two wait");
    assert_eq!(s.stats().num_fair_share_requeues_total, 3);
    // The waiting choices recompute from the prefix cache once a seat is theirs.
    let hits = s.stats().prefix_cache_hits;
    while s.num_waiting() > 0 {
        step(&mut s, 5);
        assert!(s.seats_of("wide") <= 3);
    }
    assert!(s.stats().prefix_cache_hits > hits);
}

#[test]
fn a_running_prompt_gives_back_the_forks_it_reserved_before_any_sequence() {
    let mut cfg = config(2);
    cfg.long_prefill_token_threshold = Some(4);
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request("wide", &prompt(20, 0), params(3, 6)).unwrap();
    step(&mut s, 5);
    assert_eq!(s.seats_of("wide"), 6, "alone, the prompt holds a seat for each choice");
    s.add_request("small", &prompt(3, 100), params(3, 1)).unwrap();
    let (out, _) = step(&mut s, 5);
    assert!(out.preempted.is_empty(), "the prompt keeps running, with fewer forks reserved");
    assert_eq!(s.seats_of("wide"), 2);
    assert_eq!(s.seats_of("small"), 1);
    assert_eq!(s.stats().num_fair_share_requeues_total, 0);
    while s.has_unfinished_requests() {
        step(&mut s, 5);
    }
    assert_eq!(s.kv_cache().num_free_blocks(), 256);
}

#[test]
fn a_zero_share_is_refused() {
    assert!(Scheduler::new(config(0)).is_err());
}

/// Requests with random `n` (up to the seat cap), lengths and aborts arrive faster than
/// they are served on a tight cache. After every step no request holds more than its share
/// while another is live, every request finishes, and none waits far longer than the
/// others: the slowest takes at most ten times the median (6.4x on this seed).
#[test]
fn randomized_fair_share_keeps_the_share_and_starves_no_request() {
    let mut rng = SmallRng::seed_from_u64(7);
    let cfg = SchedulerConfig {
        num_blocks: 48,
        block_size: 4,
        max_num_batched_tokens: 32,
        max_num_seqs: 8,
        max_model_len: 96,
        long_prefill_token_threshold: Some(12),
        max_num_partial_prefills: 2,
        max_seqs_per_request: Some(3),
        ..Default::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    let mut added_at: HashMap<String, usize> = HashMap::new();
    let mut ids: HashMap<RequestHandle, String> = HashMap::new();
    let mut latencies: Vec<usize> = Vec::new();
    let mut live_choices: HashMap<String, usize> = HashMap::new();
    let mut next = 0;
    let mut steps = 0;
    while next < 1500 || s.has_unfinished_requests() {
        if next < 1500 && rng.gen_bool(0.25) {
            let id = format!("r{next}");
            let n = if rng.gen_bool(0.2) { rng.gen_range(4..=8) } else { 1 };
            let len = rng.gen_range(1..40);
            let tokens: Vec<u32> = (0..len).map(|_| rng.gen_range(0..3)).collect();
            s.add_request(&id, &tokens, params(rng.gen_range(1..20), n)).unwrap();
            added_at.insert(id.clone(), steps);
            ids.insert(s.request_handle(&id).expect("live"), id.clone());
            live_choices.insert(id, n);
            next += 1;
        }
        if rng.gen_bool(0.01) && !live_choices.is_empty() {
            let id = live_choices.keys().next().cloned().expect("one");
            s.abort_request(&id).unwrap();
            live_choices.remove(&id);
        }
        let num_live = s.requests.len();
        let out = s.schedule().unwrap();
        s.check_invariants().unwrap();
        if num_live > 1 {
            let seats = s.seats_by_request();
            assert!(seats.values().all(|&n| n <= 3), "step {steps}: {seats:?}");
        }
        let sampled: Vec<u32> =
            (0..out.logits_indices.len()).map(|_| rng.gen_range(0..5)).collect();
        for update in s.update_from_output(&sampled).unwrap() {
            if update.finish_reason.is_none() {
                continue;
            }
            let id = &ids[&update.request];
            let Some(left) = live_choices.get_mut(id) else {
                continue; // aborted
            };
            *left -= 1;
            if *left == 0 {
                live_choices.remove(id);
                latencies.push(steps - added_at[id]);
            }
        }
        s.check_invariants().unwrap();
        steps += 1;
        assert!(steps < 200_000, "no progress");
    }
    assert!(live_choices.is_empty(), "every request finished: {live_choices:?}");
    assert!(latencies.len() > 1400);
    assert!(s.stats().num_fair_share_requeues_total > 100, "{:?}", s.stats());
    latencies.sort_unstable();
    let median = latencies[latencies.len() / 2];
    let slowest = *latencies.last().expect("some");
    assert!(slowest <= 10 * median.max(1), "slowest {slowest} steps, median {median}");
    assert_eq!(s.kv_cache().num_free_blocks(), 48);
}
