"""Why continuous batching matters: a mixed workload on the default model, pagedrs against
Hugging Face transformers `generate` with static batches, in one run.

Workload: N chat prompts (fixed seed), each asking for a fixed number of new tokens drawn
uniformly from 8..256, greedy, `ignore_eos` (HF: `min_new_tokens`) so both systems produce
exactly the requested lengths. Useful tokens = tokens a request asked for. HF pads each
static batch to its longest request, so it computes tokens nobody asked for.

Also: pagedrs decode step time versus batch size, the runner's own per-step Python overhead
(everything but the model's forward and the sampler's math), and KV slack from block
granularity over the run.

    .venv/bin/python benches/bench_mixed_workload.py [--requests 64] [--hf-batch 8]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch

import pagedrs
from pagedrs import LLM, SamplingParams
from pagedrs.bench.hf_baseline import load_hf_model, run_static_batches
from pagedrs.memory import block_slack

TOPICS = ["the sea", "a city at night", "music", "old trees", "space travel", "a market", "rain", "bread"]


def workload(llm: LLM, num_requests: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [
        llm.apply_chat_template([{"role": "user", "content": f"Write about {rng.choice(TOPICS)} (#{i})."}])
        for i in range(num_requests)
    ]
    return prompts, [rng.randint(8, 256) for _ in prompts]


def run_pagedrs(llm: LLM, prompts, lengths) -> dict:
    engine = llm.engine
    for i, (prompt, length) in enumerate(zip(prompts, lengths)):
        engine.add_request(f"mix-{i}", prompt, SamplingParams(temperature=0, max_tokens=length, ignore_eos=True))
    allocated = unused = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        out = engine.last_schedule
        if out is not None and len(out):
            # Tail waste of every running sequence, as the allocator lays it out.
            slack = block_slack(out.context_lens.tolist(), engine.config.block_size)
            allocated += slack.total_allocated_slots
            unused += slack.total_slack
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "useful_tokens": sum(lengths), "slack_fraction": unused / allocated}


class _Timed:
    """Wraps a callable and adds up the seconds spent in it."""

    def __init__(self, function):
        self.function = function
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.function(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def decode_step_times(llm: LLM, batch_sizes: list[int], steps: int = 12) -> dict:
    """Median step time once every request decodes, and the runner's own Python overhead:
    the step minus the model's forward and the sampler."""
    engine = llm.engine
    original_forward, original_sampler = engine.model.forward, engine.sampler
    forward, sampler = _Timed(original_forward), _Timed(original_sampler)
    engine.model.forward, engine.sampler = forward, sampler
    results = {}
    try:
        prompt = llm.apply_chat_template([{"role": "user", "content": "Count slowly."}])
        for size in batch_sizes:
            ids = [f"dec-{size}-{i}" for i in range(size)]
            for request_id in ids:
                engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True))
            while engine.scheduler.num_waiting or engine.scheduler.stats().step_num_prefill_tokens:
                engine.step()
            totals, overheads = [], []
            for _ in range(steps):
                forward.seconds = sampler.seconds = 0.0
                start = time.perf_counter()
                engine.step()
                total = time.perf_counter() - start
                totals.append(total)
                overheads.append(total - forward.seconds - sampler.seconds)
            for request_id in ids:
                engine.abort_request(request_id)
            results[size] = {
                "step_ms": round(1e3 * statistics.median(totals), 2),
                "overhead_ms": round(1e3 * statistics.median(overheads), 3),
            }
    finally:
        engine.model.forward, engine.sampler = original_forward, original_sampler
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true", help="only the pagedrs side")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    llm = LLM(kv_cache_memory="1GiB", max_num_seqs=64, max_num_batched_tokens=1024, block_size=args.block_size)
    prompts, lengths = workload(llm, args.requests, args.seed)
    ours = run_pagedrs(llm, prompts, lengths)
    steps = decode_step_times(llm, [1, 8, 16, 32, 64])
    if args.skip_hf:
        print(json.dumps({"block_size": args.block_size, "pagedrs_useful_tok_s": round(ours["useful_tokens"] / ours["seconds"], 1),
                          "kv_slack_fraction": round(ours["slack_fraction"], 4), "decode_steps": steps}, indent=2))
        return

    hf_model, _ = load_hf_model()
    theirs = run_static_batches(hf_model, llm.get_tokenizer(), prompts, lengths, args.hf_batch)

    ours_rate = ours["useful_tokens"] / ours["seconds"]
    theirs_rate = theirs["useful_tokens"] / theirs["seconds"]
    record = {
        "pagedrs": pagedrs.__version__, "torch": torch.__version__, "threads": args.threads,
        "cpu": platform.processor() or platform.machine(), "model": llm.engine.model_name, "dtype": "float32",
        "requests": args.requests, "output_lengths": "uniform 8..256", "seed": args.seed,
        "block_size": args.block_size,
        "pagedrs_useful_tok_s": round(ours_rate, 1), "pagedrs_seconds": round(ours["seconds"], 1),
        "kv_slack_fraction": round(ours["slack_fraction"], 4),
        "hf_useful_tok_s": round(theirs_rate, 1), "hf_seconds": round(theirs["seconds"], 1),
        "hf_batch": args.hf_batch, "hf_useful_share": round(theirs["useful_tokens"] / theirs["generated_tokens"], 3),
        "ratio": round(ours_rate / theirs_rate, 2), "decode_steps": steps,
    }
    print(json.dumps(record, indent=2))
    print(f"\nuseful tok/s: pagedrs {ours_rate:.1f}, HF static batches of {args.hf_batch} {theirs_rate:.1f} "
          f"({record['ratio']}x); HF useful share {record['hf_useful_share']:.0%}; KV slack {ours['slack_fraction']:.2%}")
    print("batch | pagedrs step ms | runner overhead ms")
    for size, numbers in steps.items():
        print(f"{size:5d} | {numbers['step_ms']:15.1f} | {numbers['overhead_ms']:18.2f}")


if __name__ == "__main__":
    main()
