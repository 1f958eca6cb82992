"""Why continuous batching matters: a mixed workload on the default model, pagedrs against
Hugging Face transformers `generate` with static batches, in one run.

Workload: N chat prompts (fixed seed), each asking for a fixed number of new tokens drawn
uniformly from 8..256, `ignore_eos` (HF: `min_new_tokens`) so both systems produce exactly
the requested lengths; run greedy and sampled (temperature 1.0, top_p 0.95 by default: what
clients send) on both sides. Useful tokens = tokens a request asked for. HF pads each static
batch to its longest request, so it computes tokens nobody asked for.

Also: pagedrs decode step time versus batch size, the runner's own per-step Python overhead
(everything but the model's forward and the sampler's math), and KV slack from block
granularity over the run.

    .venv/bin/python benches/bench_mixed_workload.py [--requests 64] [--hf-batch 8] [--temperature 1.0 --top-p 0.95]
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


def run_pagedrs(llm: LLM, prompts, lengths, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    engine = llm.engine
    for i, (prompt, length) in enumerate(zip(prompts, lengths)):
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=length, ignore_eos=True)
        engine.add_request(f"mix-{temperature}-{i}", prompt, params)
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

    def __getattr__(self, name):
        return getattr(self.function, name)


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
                engine.add_request(
                    request_id, prompt, SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
                )
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
    parser.add_argument("--temperature", type=float, default=1.0, help="the sampled run's temperature")
    parser.add_argument("--top-p", type=float, default=0.95, help="the sampled run's top_p")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    llm = LLM(kv_cache_memory="1GiB", max_num_seqs=64, max_num_batched_tokens=1024, block_size=args.block_size)
    prompts, lengths = workload(llm, args.requests, args.seed)
    settings = {"greedy": (0.0, 1.0), f"t{args.temperature} top_p{args.top_p}": (args.temperature, args.top_p)}
    ours = {name: run_pagedrs(llm, prompts, lengths, *sampling) for name, sampling in settings.items()}
    steps = decode_step_times(llm, [1, 8, 16, 32, 64])
    record = {
        "pagedrs": pagedrs.__version__,
        "torch": torch.__version__,
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "model": llm.engine.model_name,
        "dtype": "float32",
        "requests": args.requests,
        "output_lengths": "uniform 8..256",
        "seed": args.seed,
        "block_size": args.block_size,
        "useful_tokens": sum(lengths),
        "kv_slack_fraction": round(ours["greedy"]["slack_fraction"], 4),
        "decode_steps": steps,
        "settings": {},
    }
    for name, run in ours.items():
        record["settings"][name] = {
            "pagedrs_useful_tok_s": round(run["useful_tokens"] / run["seconds"], 1),
            "pagedrs_seconds": round(run["seconds"], 1),
        }
    if not args.skip_hf:
        hf_model, _ = load_hf_model()
        for name, (temperature, top_p) in settings.items():
            theirs = run_static_batches(
                hf_model, llm.get_tokenizer(), prompts, lengths, args.hf_batch, temperature=temperature, top_p=top_p
            )
            entry = record["settings"][name]
            entry.update(
                hf_useful_tok_s=round(theirs["useful_tok_s"], 1),
                hf_seconds=round(theirs["seconds"], 1),
                hf_batch=args.hf_batch,
                hf_useful_share=round(theirs["useful_share"], 3),
                ratio=round(entry["pagedrs_useful_tok_s"] / theirs["useful_tok_s"], 2),
            )
    print(json.dumps(record, indent=2))
    greedy_rate = record["settings"]["greedy"]["pagedrs_useful_tok_s"]
    print(f"\n{'setting':<22} {'pagedrs tok/s':>14} {'vs greedy':>10} {'HF tok/s':>9} {'ratio':>6}")
    for name, entry in record["settings"].items():
        print(
            f"{name:<22} {entry['pagedrs_useful_tok_s']:>14.1f} {entry['pagedrs_useful_tok_s'] / greedy_rate:>10.2f} "
            f"{entry.get('hf_useful_tok_s', float('nan')):>9.1f} {entry.get('ratio', float('nan')):>6}"
        )
    print(f"KV slack {ours['greedy']['slack_fraction']:.2%}")
    print("batch | pagedrs step ms | runner overhead ms")
    for size, numbers in steps.items():
        print(f"{size:5d} | {numbers['step_ms']:15.1f} | {numbers['overhead_ms']:18.2f}")


if __name__ == "__main__":
    main()
