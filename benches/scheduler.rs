//! Scheduler benches: the CPU cost of one engine iteration without the model.
//!
//! `decode_step/{64,256,1024}`: one steady decode iteration, `schedule()` +
//! `update_from_output()`, with that many running requests of 512-token prompts (prefix
//! caching on, no shared prefix). Requests are prefilled before timing; every 128 timed
//! steps (untimed) they are aborted and replaced, so contexts stay within 512..640 tokens.
//! `decode_step_caching_off/1024` is the same without prefix caching, to price caching at a
//! 0% hit rate.
//! `decode_step_speculative/{ngram,suffix}`: the same iteration at 256 running requests with
//! speculative decoding (k = 4): prompts repeat a 7-token pattern and the fake model
//! continues it, so each sequence finds 4 proposals in its index every step and all are
//! accepted (5 tokens a step).
//! `admit_256_shared_prefix`: `add_request` of 256 prompts sharing a 448-token prefix (64
//! tokens of their own) and the `schedule()` that admits them all.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pagedrs::{
    RequestParams, Scheduler, SchedulerConfig, SpeculativeConfig, SpeculativeMethod, StopConditions,
};

const PROMPT_LEN: usize = 512;
const STEPS_PER_BATCH: usize = 128;

fn scheduler(num_running: usize, enable_prefix_caching: bool) -> Scheduler {
    let blocks_per_request = (PROMPT_LEN + STEPS_PER_BATCH) / 16 + 2;
    Scheduler::new(SchedulerConfig {
        num_blocks: num_running * blocks_per_request * 2,
        block_size: 16,
        enable_prefix_caching,
        max_num_batched_tokens: 65536,
        max_num_seqs: num_running,
        max_model_len: 4096,
        ..Default::default()
    })
    .unwrap()
}

fn params() -> RequestParams {
    RequestParams {
        stop: StopConditions { max_tokens: 100_000, ignore_eos: true, ..Default::default() },
        ..Default::default()
    }
}

/// Adds `num_running` distinct 512-token requests and runs them until all are decoding.
fn fill(s: &mut Scheduler, num_running: usize, batch: usize) -> Vec<String> {
    let ids: Vec<String> = (0..num_running).map(|i| format!("b{batch}-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        let first = (batch * num_running + i) as u32;
        let prompt: Vec<u32> =
            (0..PROMPT_LEN as u32).map(|t| first.wrapping_mul(7919) + t).collect();
        s.add_request(id, &prompt, params()).unwrap();
    }
    loop {
        let out = s.schedule().unwrap();
        s.update_from_output(&vec![1; out.logits_indices.len()]).unwrap();
        if out.num_prefill_tokens == 0 {
            return ids;
        }
    }
}

fn decode_steps(c: &mut Criterion, name: &str, sizes: &[usize], enable_prefix_caching: bool) {
    let mut group = c.benchmark_group(name);
    for &num_running in sizes {
        group.bench_with_input(BenchmarkId::from_parameter(num_running), &num_running, |b, &n| {
            let mut s = scheduler(n, enable_prefix_caching);
            let mut batch = 0;
            let mut ids = fill(&mut s, n, batch);
            let mut steps_in_batch = 0;
            let sampled = vec![1u32; n];
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    if steps_in_batch == STEPS_PER_BATCH {
                        for id in &ids {
                            s.abort_request(id).unwrap();
                        }
                        batch += 1;
                        ids = fill(&mut s, n, batch);
                        steps_in_batch = 0;
                    }
                    let start = Instant::now();
                    let out = s.schedule().unwrap();
                    let updates = s.update_from_output(&sampled).unwrap();
                    total += start.elapsed();
                    assert_eq!(out.num_decode_tokens, n);
                    black_box((out, updates));
                    steps_in_batch += 1;
                }
                total
            });
        });
    }
    group.finish();
}

fn bench_decode(c: &mut Criterion) {
    decode_steps(c, "decode_step", &[64, 256, 1024], true);
    decode_steps(c, "decode_step_caching_off", &[1024], false);
}

fn bench_speculative(c: &mut Criterion) {
    let n = 256;
    let methods = [
        ("ngram", SpeculativeMethod::Ngram { min_n: 2, max_n: 4 }),
        (
            "suffix",
            SpeculativeMethod::Suffix {
                max_depth: 24,
                min_token_prob: 0.1,
                max_spec_factor: 1.0,
                max_cached_requests: 10_000,
            },
        ),
    ];
    let mut group = c.benchmark_group("decode_step_speculative");
    for (name, method) in methods {
        group.bench_function(name, |b| {
            let blocks_per_request = (PROMPT_LEN + 5 * STEPS_PER_BATCH + 8) / 16 + 2;
            let mut s = Scheduler::new(SchedulerConfig {
                num_blocks: n * blocks_per_request * 2,
                block_size: 16,
                max_num_batched_tokens: 65536,
                max_num_seqs: n,
                max_model_len: 4096,
                speculative: Some(SpeculativeConfig {
                    method: method.clone(),
                    num_speculative_tokens: 4,
                    disable_by_batch_size: None,
                }),
                ..Default::default()
            })
            .unwrap();
            let mut batch = 0;
            let mut ids = fill_periodic(&mut s, n, batch);
            let mut steps_in_batch = 0;
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut sampled = Vec::new();
                for _ in 0..iters {
                    if steps_in_batch == STEPS_PER_BATCH {
                        for id in &ids {
                            s.abort_request(id).unwrap();
                        }
                        batch += 1;
                        ids = fill_periodic(&mut s, n, batch);
                        steps_in_batch = 0;
                    }
                    let start = Instant::now();
                    let out = s.schedule().unwrap();
                    sampled.clear();
                    sampled.extend(
                        out.logits_indices
                            .iter()
                            .map(|&row| pattern(out.positions[row as usize] + 1)),
                    );
                    let updates = s.update_from_output(&sampled).unwrap();
                    total += start.elapsed();
                    black_box((out, updates));
                    steps_in_batch += 1;
                }
                total
            });
            assert!(s.stats().num_accepted_tokens_total > 0, "{name} never proposed");
        });
    }
    group.finish();
}

/// The token at `position` of the repeating pattern.
fn pattern(position: i64) -> u32 {
    100 + (position % 7) as u32
}

/// `fill` with prompts that repeat a 7-token pattern after a first token of their own (so
/// they share no block), answered by the pattern's continuation.
fn fill_periodic(s: &mut Scheduler, num_running: usize, batch: usize) -> Vec<String> {
    let ids: Vec<String> = (0..num_running).map(|i| format!("p{batch}-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        let mut prompt: Vec<u32> = (0..PROMPT_LEN as i64).map(pattern).collect();
        prompt[0] = 1000 + (batch * num_running + i) as u32;
        s.add_request(id, &prompt, params()).unwrap();
    }
    loop {
        let out = s.schedule().unwrap();
        let sampled: Vec<u32> = out
            .logits_indices
            .iter()
            .map(|&row| pattern(out.positions[row as usize] + 1))
            .collect();
        s.update_from_output(&sampled).unwrap();
        if out.num_prefill_tokens == 0 {
            return ids;
        }
    }
}

fn bench_admission(c: &mut Criterion) {
    let shared: Vec<u32> = (0..448).map(|t| 50_000 + t).collect();
    c.bench_function("admit_256_shared_prefix", |b| {
        let mut s = scheduler(256, true);
        let mut batch = 0u32;
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                batch += 1;
                let ids: Vec<String> = (0..256).map(|i| format!("a{batch}-{i}")).collect();
                let prompts: Vec<Vec<u32>> = (0..256u32)
                    .map(|i| {
                        let mut prompt = shared.clone();
                        prompt.extend((0..64).map(|t| batch * 100_000 + i * 64 + t));
                        prompt
                    })
                    .collect();
                let start = Instant::now();
                for (id, prompt) in ids.iter().zip(&prompts) {
                    s.add_request(id, prompt, params()).unwrap();
                }
                let out = s.schedule().unwrap();
                total += start.elapsed();
                assert_eq!(out.sequence_ids.len(), 256);
                s.update_from_output(&vec![1; out.logits_indices.len()]).unwrap();
                for id in &ids {
                    s.abort_request(id).unwrap();
                }
            }
            total
        });
    });
}

criterion_group!(benches, bench_decode, bench_speculative, bench_admission);
criterion_main!(benches);
