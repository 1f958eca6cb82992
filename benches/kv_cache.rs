//! KV cache manager benches: what admitting and freeing a request costs on the CPU.
//!
//! Each `admit_free_512` iteration is a whole request life as the scheduler drives it:
//! `add_request` (512 prompt tokens) + `get_computed_blocks` (hashing and lookup) +
//! `allocate_slots(512)` (32 blocks, caching the full ones) + `free`.
//! `lookup_4096_cached` is `add_request` + `get_computed_blocks` of a 4096-token prompt
//! whose blocks are all cached, including hashing its 255 full blocks, then `free`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use pagedrs::KVCacheManager;

const BLOCK_SIZE: usize = 16;
const NUM_BLOCKS: usize = 4096;

fn admit_and_free(manager: &mut KVCacheManager, prompt: &[u32]) {
    let id = manager.add_sequence(prompt, None).unwrap();
    let num_cached = manager.get_computed_blocks(id).unwrap();
    let copies = manager.allocate_slots(id, prompt.len() - num_cached).unwrap();
    black_box(copies.expect("the pool is large enough"));
    manager.free(id).unwrap();
}

fn bench_admit_free(c: &mut Criterion) {
    let mut group = c.benchmark_group("admit_free_512");
    let prompt: Vec<u32> = (0..512).map(|i| 1000 + i).collect();

    group.bench_function("caching_off", |b| {
        let mut manager = KVCacheManager::new(NUM_BLOCKS, BLOCK_SIZE, false, "bench").unwrap();
        b.iter(|| admit_and_free(&mut manager, &prompt));
    });

    group.bench_function("caching_on_no_hit", |b| {
        // Every prompt starts with a new token, so no block is ever shared; in steady state
        // each allocation evicts a block cached by an earlier request.
        let mut manager = KVCacheManager::new(NUM_BLOCKS, BLOCK_SIZE, true, "bench").unwrap();
        let mut prompt = prompt.clone();
        let mut next = 0u64;
        b.iter(|| {
            next += 1;
            prompt[0] = next as u32;
            admit_and_free(&mut manager, &prompt);
        });
        assert_eq!(manager.stats().prefix_cache_hits, 0);
    });

    group.bench_function("caching_on_448_shared", |b| {
        // 448 shared tokens (28 blocks) then 64 tokens of its own per request.
        let mut manager = KVCacheManager::new(NUM_BLOCKS, BLOCK_SIZE, true, "bench").unwrap();
        let mut prompt = prompt.clone();
        let mut next = 0u64;
        admit_and_free(&mut manager, &prompt);
        b.iter(|| {
            next += 1;
            prompt[448] = next as u32;
            admit_and_free(&mut manager, &prompt);
        });
        let stats = manager.stats();
        assert_eq!(stats.prefix_cache_hits, 448 * next);
    });
    group.finish();
}

fn bench_lookup(c: &mut Criterion) {
    let prompt: Vec<u32> = (0..4096).map(|i| (i * 7919) % 49152).collect();
    let mut manager = KVCacheManager::new(NUM_BLOCKS, BLOCK_SIZE, true, "bench").unwrap();
    admit_and_free(&mut manager, &prompt);
    c.bench_function("lookup_4096_cached", |b| {
        b.iter(|| {
            let id = manager.add_sequence(&prompt, None).unwrap();
            assert_eq!(manager.get_computed_blocks(id).unwrap(), 4080);
            manager.free(id).unwrap();
        });
    });
}

criterion_group!(benches, bench_admit_free, bench_lookup);
criterion_main!(benches);
